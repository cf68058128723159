// The one process-wide object jaxcomm keeps: services and settings every communicator
// shares. Everything else lives in per-instruction state owned by XLA's executables.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/completion_pool.h"
#include "core/cross_process.h"
#include "core/env.h"
#include "core/fault_injection.h"
#include "core/flight_recorder.h"
#include "core/watchdog.h"

namespace jaxcomm {

class RoundTable;

// JAXCOMM_MISMATCH_GRACE_S's default (jaxcomm/_src/config.py documents it).
constexpr int64_t kDefaultMismatchGraceMs = 3000;

class Registry {
 public:
  static Registry& Get();

  // Fires the deadline of rounds some rank never joins (started on first use).
  Watchdog& watchdog();
  // Runs data movement and completes futures off the device threads.
  CompletionPool& pool() { return pool_; }

  // How long idle pool threads spin (yielding) before they sleep.
  std::chrono::microseconds spin() const { return std::chrono::microseconds(spin_us_.load()); }
  void set_spin(std::chrono::microseconds us);

  // Results of at least this many bytes (one rank's) are written with non-temporal
  // stores (cpu/result_stores.h); 0: never. JAXCOMM_NONTEMPORAL_BYTES.
  int64_t nontemporal_bytes() const { return nontemporal_bytes_.load(std::memory_order_relaxed); }
  void set_nontemporal_bytes(int64_t bytes) { nontemporal_bytes_.store(bytes < 0 ? 0 : bytes, std::memory_order_relaxed); }

  // What the runtime read from the environment when it started (core/env.h), and the
  // malformed variables among it (Python raises the first before any op runs).
  const Settings& settings() const { return settings_; }

  // Whether streamed rounds may read the peers' operands directly (process_vm_readv)
  // where the kernel allows it; JAXCOMM_SINGLE_COPY. Links made while it is off are
  // never read directly.
  bool single_copy() const { return single_copy_.load(std::memory_order_relaxed); }
  void set_single_copy(bool on) { single_copy_.store(on, std::memory_order_relaxed); }

  // Whether the host MoE combine may convert float16 with the CPU's F16C instructions
  // where it has them (cpu/moe_convert.h); JAXCOMM_CPU_F16C. Off: the portable kernels.
  bool cpu_f16c() const { return cpu_f16c_.load(std::memory_order_relaxed); }
  void set_cpu_f16c(bool on) { cpu_f16c_.store(on, std::memory_order_relaxed); }

  // The most bytes this process holds for cross-process collectives: shared-memory
  // segments, and per TCP link its early frames and spare buffers
  // (JAXCOMM_COMM_MEMORY_MB). A call that would need more shared memory fails, naming it.
  int64_t comm_memory_limit() const { return comm_memory_limit_.load(std::memory_order_relaxed); }

  // How long a rank waits in a collective before jaxcomm looks for peers waiting in
  // another one (core/mismatch.h); 0: never. JAXCOMM_MISMATCH_GRACE_S, set from Python.
  std::chrono::milliseconds mismatch_grace() const {
    return std::chrono::milliseconds(mismatch_grace_ms_.load(std::memory_order_relaxed));
  }
  void set_mismatch_grace(std::chrono::milliseconds ms) {
    mismatch_grace_ms_.store(ms.count() < 0 ? 0 : ms.count(), std::memory_order_relaxed);
  }

  // The instructions' round tables (one per custom-call instruction per executable):
  // the mismatch check looks at every round waiting in this process. Tables register
  // when instantiated; the list holds them weakly.
  void AddTable(std::weak_ptr<RoundTable> table);
  std::vector<std::shared_ptr<RoundTable>> Tables();

  // This process's index in the job (jax.process_index()), set when handlers register.
  int64_t process_index() const { return process_index_.load(std::memory_order_relaxed); }
  void set_process_index(int64_t i) { process_index_.store(i, std::memory_order_relaxed); }

  // Moves inputs between processes for groups that span several (null until the
  // extension installs its host transports).
  CrossProcess* cross_process() const { return cross_process_.get(); }
  void set_cross_process(std::unique_ptr<CrossProcess> c) { cross_process_ = std::move(c); }

  // How many processes of the job run on this host (this one included): they share its
  // cores. Set as shared-memory peers are linked.
  int host_processes() const { return host_processes_.load(std::memory_order_relaxed); }
  void set_host_processes(int n) { host_processes_.store(n, std::memory_order_relaxed); }

  // Distinguishes instructions with identical attributes (a nested jit inlined twice):
  // how many instructions with this attribute hash were instantiated before. Every
  // process instantiates the programs it shares with others in the same order.
  uint64_t NextOccurrence(uint64_t attribute_hash);

  // The flight recorder (JAXCOMM_TRACE_ENTRIES, JAXCOMM_TRACE_DIR) and injected faults
  // (JAXCOMM_FAULT), both configured once from the environment.
  FlightRecorder& recorder() { return recorder_; }
  FaultInjector& faults() { return faults_; }

  // Rounds completed and failed since start (tests, stats).
  std::atomic<int64_t> rounds_completed{0};
  std::atomic<int64_t> rounds_failed{0};
  // Times a thread waiting for a peer process moved off the core that peer spun on
  // (cpu/world_internal.h, PeerSpin).
  std::atomic<int64_t> core_moves{0};
  // Streamed rounds that read the peers' operands directly (cpu/world_stream.cc, Pull).
  std::atomic<int64_t> single_copy_rounds{0};
  // Rounds a device thread completed inline (core/rendezvous.h, RoundTable::ArriveInline).
  std::atomic<int64_t> inline_rounds{0};

 private:
  Registry();
  const Settings settings_;
  std::atomic<int64_t> spin_us_;
  std::atomic<int64_t> nontemporal_bytes_;
  std::atomic<bool> single_copy_;
  std::atomic<bool> cpu_f16c_;
  std::atomic<int64_t> comm_memory_limit_;
  std::atomic<int64_t> mismatch_grace_ms_{kDefaultMismatchGraceMs};
  std::atomic<int64_t> process_index_{0};
  std::atomic<int> host_processes_{1};
  CompletionPool pool_;
  FlightRecorder recorder_;
  FaultInjector faults_;
  std::once_flag watchdog_once_;
  std::unique_ptr<Watchdog> watchdog_;
  std::unique_ptr<CrossProcess> cross_process_;
  std::mutex tables_mu_;
  std::vector<std::weak_ptr<RoundTable>> tables_;
  std::mutex occurrences_mu_;
  std::map<uint64_t, uint64_t> occurrences_;
};

}  // namespace jaxcomm
