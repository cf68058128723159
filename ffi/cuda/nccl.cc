#include "cuda/nccl.h"

#include <dlfcn.h>

#include <limits>
#include <memory>
#include <vector>

namespace jaxcomm::cuda {
namespace {

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::string& SearchPath() {
  static std::string path;
  return path;
}

struct DlCloser {
  // NCCL keeps proxy threads running inside the library; unloading it under them would
  // crash at exit, so a successfully loaded handle is never closed (see Load).
  void operator()(void* h) const {
    if (h != nullptr) dlclose(h);
  }
};
using DlHandle = std::unique_ptr<void, DlCloser>;

template <typename F>
bool Sym(void* lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr && missing != nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

// Loads NCCL from the first candidate that opens; "" on success.
std::string Load(NcclApi* api) {
  std::vector<std::string> candidates;
  if (!SearchPath().empty()) candidates.push_back(SearchPath());
#ifdef JAXCOMM_CUDA_EMULATION  // the mock NCCL (ffi/cuda_emu/nccl) beside the module, never a real one
  candidates.push_back("libjaxcomm_nccl_mock.so");
#else
  candidates.push_back("libnccl.so.2");
  candidates.push_back("libnccl.so");
#endif
  std::string tried;
  DlHandle lib;
  for (const std::string& c : candidates) {
    lib.reset(dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL));
    if (lib) {
      api->path = c;
      break;
    }
    const char* why = dlerror();
    tried += "\n  " + c + ": " + (why ? why : "not found");
  }
  if (!lib) {
    return "jaxcomm CUDA backend: cannot load NCCL (install jax's CUDA extra, which brings it: "
           "pip install 'jax[cuda13]' (nvidia-nccl-cu13) or 'jax[cuda12]' (nvidia-nccl-cu12); or set "
           "JAXCOMM_NCCL_LIBRARY=/path/libnccl.so.2); tried:" + tried;
  }
  void* h = lib.get();
  std::string missing;
  Sym(h, "ncclGetVersion", &api->GetVersion, &missing);
  Sym(h, "ncclGetUniqueId", &api->GetUniqueId, &missing);
  Sym(h, "ncclCommInitRankConfig", &api->CommInitRankConfig, &missing);
  Sym(h, "ncclCommDestroy", &api->CommDestroy, &missing);
  Sym(h, "ncclCommAbort", &api->CommAbort, &missing);
  Sym(h, "ncclCommGetAsyncError", &api->CommGetAsyncError, &missing);
  Sym(h, "ncclGetErrorString", &api->GetErrorString, &missing);
  Sym(h, "ncclAllReduce", &api->AllReduce, &missing);
  Sym(h, "ncclAllGather", &api->AllGather, &missing);
  Sym(h, "ncclReduceScatter", &api->ReduceScatter, &missing);
  Sym(h, "ncclBroadcast", &api->Broadcast, &missing);
  Sym(h, "ncclSend", &api->Send, &missing);
  Sym(h, "ncclRecv", &api->Recv, &missing);
  Sym(h, "ncclGroupStart", &api->GroupStart, &missing);
  Sym(h, "ncclGroupEnd", &api->GroupEnd, &missing);
  Sym(h, "ncclGetLastError", &api->GetLastError, nullptr);  // optional
  if (!missing.empty()) {
    return "jaxcomm CUDA backend: " + api->path + " lacks NCCL symbols: " + missing;
  }
  int v = 0;
  if (api->GetVersion(&v) != ncclSuccess) return "jaxcomm CUDA backend: ncclGetVersion failed";
  api->version = v;
  lib.release();  // kept loaded for the life of the process (see DlCloser)
  return "";
}

}  // namespace

ncclConfig_t NcclConfig(int blocking) {
  constexpr int kUndef = std::numeric_limits<int>::min();  // NCCL_CONFIG_UNDEF_INT
  ncclConfig_t c;
  c.size = sizeof(ncclConfig_t);
  c.magic = 0xcafebeef;  // NCCL_API_MAGIC
  c.version = 21700;     // NCCL_VERSION(2, 17, 0): the fields above
  c.blocking = blocking;
  c.cgaClusterSize = c.minCTAs = c.maxCTAs = c.splitShare = kUndef;
  c.netName = nullptr;
  return c;
}

void NcclApi::SetSearchPath(std::string path) {
  std::lock_guard<std::mutex> lock(Mu());
  SearchPath() = std::move(path);
}

const NcclApi* NcclApi::Get(std::string* error) {
  std::lock_guard<std::mutex> lock(Mu());
  static NcclApi api;
  static bool loaded = false;
  static std::string load_error;
  // A failed load is retried on the next call: the search path may be set meanwhile.
  if (!loaded) {
    NcclApi fresh;
    load_error = Load(&fresh);
    if (load_error.empty()) {
      api = fresh;
      loaded = true;
    }
  }
  if (!loaded) {
    if (error != nullptr) *error = load_error;
    return nullptr;
  }
  return &api;
}

std::string NcclApi::Describe(ncclResult_t r, ncclComm_t comm) const {
  std::string s = GetErrorString ? GetErrorString(r) : "NCCL error";
  s += " (ncclResult_t " + std::to_string(static_cast<int>(r)) + ")";
  if (GetLastError != nullptr) {
    const char* last = GetLastError(comm);
    if (last != nullptr && *last != '\0') s += ": " + std::string(last);
  }
  return s;
}

}  // namespace jaxcomm::cuda
