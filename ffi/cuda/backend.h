// The CUDA backend's process-wide state, in one object: the NCCL communicators, what the
// job's processes published about themselves, the CUDA IPC mappings of peer processes'
// buffers and events, the completion watcher, and the split-phase MoE sends waiting for
// their receive halves. Created on first use and never
// destroyed: communicators and mappings torn down during interpreter exit would race
// with the CUDA driver's own teardown (NCCL's proxy threads would touch a dead context).
#pragma once

#include "cuda/ipc.h"
#include "cuda/nccl_comm.h"
#include "cuda/routes.h"
#include "cuda/split.h"
#include "cuda/watcher.h"

namespace jaxcomm::cuda {

class Backend {
 public:
  static Backend& Get() {
    static Backend* backend = new Backend();
    return *backend;
  }
  CommRegistry& comms() { return comms_; }
  ProcessTable& processes() { return processes_; }
  IpcRegistry& ipc() { return ipc_; }
  CompletionWatcher& watcher() { return watcher_; }
  SplitSends& splits() { return splits_; }

 private:
  Backend() = default;
  CommRegistry comms_;
  ProcessTable processes_;
  IpcRegistry ipc_;
  CompletionWatcher watcher_;
  SplitSends splits_;
};

}  // namespace jaxcomm::cuda
