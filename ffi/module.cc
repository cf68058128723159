// The extension module: hands XLA FFI handler capsules and the state type to Python,
// which registers them (jaxcomm/_src/runtime.py). No XLA symbol is linked in: handlers
// reach XLA only through the FFI C API table passed at call time.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/cpu_affinity.h"
#include "core/registry.h"
#include "core/rendezvous.h"
#include "cpu/moe_convert.h"  // HasF16c
#include "cpu/transport/factory.h"
#include "cpu/transport/world.h"
#include "xla/ffi/api/ffi.h"
#include "trace_stats_bindings.h"

namespace nb = nanobind;

namespace jaxcomm {
void RegisterOpTable(nb::module_& m);  // ffi/op_table_bindings.cc
}

namespace jaxcomm::cuda {
// The CUDA backend's host-side logic, in every build (ffi/cuda/logic_bindings.cc).
void RegisterKernelLogic(nb::module_& m);
#ifdef JAXCOMM_WITH_CUDA
void RegisterCuda(nb::module_& m);  // ffi/cuda/bindings.cc
#endif
}

namespace {

// The host transports, installed in the registry when the module loads.
jaxcomm::cpu::World& World() {
  auto* world = static_cast<jaxcomm::cpu::World*>(jaxcomm::Registry::Get().cross_process());
  if (world == nullptr) {
    auto owned = std::make_unique<jaxcomm::cpu::World>();
    world = owned.get();
    jaxcomm::Registry::Get().set_cross_process(std::move(owned));
  }
  return *world;
}

const XLA_FFI_TypeInfo kInstructionStateInfo =
    xla::ffi::MakeTypeInfo<jaxcomm::InstructionState>();

}  // namespace

NB_MODULE(_jaxcomm, m) {
  m.doc() = "jaxcomm native runtime: XLA FFI handlers for the host backend";

  jaxcomm::RegisterOpTable(m);  // op_table(), cpu_targets() (ffi/op_table_bindings.cc)

  m.def("state_type", [] {
    nb::dict d;
    d["type_id"] = nb::capsule(reinterpret_cast<void*>(&jaxcomm::InstructionState::id));
    d["type_info"] = nb::capsule(reinterpret_cast<void*>(
        const_cast<XLA_FFI_TypeInfo*>(&kInstructionStateInfo)));
    return d;
  }, "The FFI type registration of the per-instruction rendezvous state.");

  m.def("set_process_index", [](int64_t i) { jaxcomm::Registry::Get().set_process_index(i); },
        "Tells the runtime which process of the job this is (jax.process_index()).");

  m.def("transport_open", [](int64_t process, const std::string& host, const std::string& label,
                             const std::vector<std::pair<std::string, jaxcomm::cpu::Params>>& transports) {
    std::string error;
    jaxcomm::cpu::Endpoints endpoints;
    {
      nb::gil_scoped_release release;
      endpoints = World().Open(process, host, label, transports, &error);
    }
    if (!error.empty()) throw std::runtime_error("jaxcomm: opening this process's endpoint: " + error);
    return endpoints;
  }, nb::arg("process"), nb::arg("host"), nb::arg("label"), nb::arg("transports"),
     "Opens this process's transports: `transports` is [(name, {field: text})] in the order of "
     "preference for a link (names: transport_names()); `host` its host key (processes with the "
     "same key share memory), `label` how messages name its host. Returns each transport's "
     "endpoint, {name: {field: text}}: what a peer needs to link to it.");

  m.def("transport_names", [] { return jaxcomm::cpu::TransportNames(); },
        "The transports this build has (ffi/cpu/transport/factory.cc).");

  m.def("transport_refused", [] {
    auto* world = static_cast<jaxcomm::cpu::World*>(jaxcomm::Registry::Get().cross_process());
    return world != nullptr ? world->refused_connections() : 0;
  }, "TCP connections this process's listener refused (no jaxcomm hello, wrong job secret, ...).");

  m.def("transport_link", [](int64_t process, const std::string& label, const std::string& peer_host, int pid,
                             const jaxcomm::cpu::Endpoints& endpoints, int64_t timeout_ms, bool rejoining) {
    jaxcomm::cpu::PeerIdentity who;
    who.process = process;
    who.host = label;
    who.host_key = peer_host;
    who.pid = pid;
    std::string error;
    {
      nb::gil_scoped_release release;
      error = World().Link(who, endpoints, std::chrono::milliseconds(timeout_ms), rejoining);
    }
    if (!error.empty()) throw std::runtime_error("jaxcomm: linking process " + std::to_string(process) + ": " + error);
  }, nb::arg("process"), nb::arg("label"), nb::arg("peer_host"), nb::arg("pid"), nb::arg("endpoints"),
     nb::arg("timeout_ms"), nb::arg("rejoining") = false,
     "Links peer `process` (idempotent) through the first transport this process opened that it "
     "opened too and that reaches it; `label` names its host in messages, `peer_host` is its host "
     "key, `endpoints` its transport_open result.");

  m.def("transport_close", [] {
    auto* world = static_cast<jaxcomm::cpu::World*>(jaxcomm::Registry::Get().cross_process());
    if (world == nullptr) return;
    nb::gil_scoped_release release;
    world->Close();
  }, "Stops the transports' background work (the MPI transport's, before MPI_Finalize).");

  m.def("excluded_processes", [] { return World().excluded(); },
        "Processes left out after they failed in a fault-tolerant collective.");

  m.def("transport_rejoin", [](uint64_t generation) {
    std::string error = World().Rejoin(generation);
    if (!error.empty()) throw std::runtime_error("jaxcomm.ft.rejoin: " + error);
  }, nb::arg("generation"), "Marks this restarted process as asking to be readmitted.");

  m.def("transport_linked", [](int64_t process) { return World().Linked(process); },
        "Whether peer `process` is linked.");
  // The emulated CUDA backend (_jaxcomm_emu, its own copy of core/) meets its peers over
  // these links too: it borrows the World (ffi/cuda_emu/module.cc, emu_borrow_cross_process).
  m.def("cross_process_capsule", [] {
    return nb::capsule(static_cast<jaxcomm::CrossProcess*>(&World()), "jaxcomm.CrossProcess");
  }, "This process's host transports (jaxcomm::CrossProcess*, never destroyed), for _jaxcomm_emu.");
  m.def("memory_report", [] {
    const auto h = World().held();
    nb::dict d;
    d["shm_control"] = h.shm_control;
    d["shm_data"] = h.shm_data;
    d["shm_data_used"] = h.shm_data_used;
    d["link_buffers"] = h.link_buffers;
    d["staging"] = h.staging;
    d["recorder"] = jaxcomm::Registry::Get().recorder().MemoryBytes();
    d["calls"] = h.calls;
    d["limit"] = jaxcomm::Registry::Get().comm_memory_limit();
    return d;
  }, "The bytes this process holds for collectives, by kind (jaxcomm.memory()).");
  m.def("transport_kind", [](int64_t process) {
    const auto* link = World().LinkOf(process);
    return link ? link->name : std::string();
  }, nb::arg("process"),
        "The kind of link to peer `process` (\"shm\", \"tcp\"), or \"\" while it is not linked.");

  m.def("set_spin_us", [](int64_t us) {
    jaxcomm::Registry::Get().set_spin(std::chrono::microseconds(us < 0 ? 0 : us));
  }, "How long a waiting rank spins (yielding) before it sleeps, in microseconds.");

  m.def("set_mismatch_grace_ms", [](int64_t ms) {
    jaxcomm::Registry::Get().set_mismatch_grace(std::chrono::milliseconds(ms));
  }, nb::arg("ms"), "How long a rank waits in a collective before jaxcomm looks for peers waiting in "
                    "another one (JAXCOMM_MISMATCH_GRACE_S), in milliseconds; 0: never.");
  m.def("mismatch_grace_ms", [] { return jaxcomm::Registry::Get().mismatch_grace().count(); },
        "The mismatch grace period in force, in milliseconds (0: no check).");

  m.def("leave_core", [](int cpu) { return jaxcomm::LeaveCore(cpu); }, nb::arg("cpu"),
        "Moves the calling thread off core `cpu`, its affinity kept (what waiting threads do).");
  m.def("core_moves", [] { return jaxcomm::Registry::Get().core_moves.load(); },
        "How often a thread waiting for a peer process moved off the core that peer spun on.");
  m.def("single_copy", [] { return jaxcomm::Registry::Get().single_copy(); },
        "Whether streamed rounds may read the peers' operands straight from their memory.");
  m.def("set_single_copy", [](bool on) { jaxcomm::Registry::Get().set_single_copy(on); }, nb::arg("on"),
        "Sets single_copy (JAXCOMM_SINGLE_COPY); off: this process offers no single-copy rounds.");
  m.def("transport_direct", [](int64_t process) { return World().ReadsDirectly(process); },
        "Whether this process may read peer `process`'s memory directly (probed when linked).");
  m.def("single_copy_rounds", [] { return jaxcomm::Registry::Get().single_copy_rounds.load(); },
        "Streamed rounds that read the peers' operands straight from their memory (JAXCOMM_SINGLE_COPY).");
  m.def("inline_rounds", [] { return jaxcomm::Registry::Get().inline_rounds.load(); },
        "Cross-process rounds a device thread completed inline, without a hand-off (JAXCOMM_INLINE).");
  m.def("cpu_f16c", [] { return jaxcomm::Registry::Get().cpu_f16c(); },
        "Whether the host MoE combine may convert float16 with the CPU's F16C instructions.");
  m.def("set_cpu_f16c", [](bool on) { jaxcomm::Registry::Get().set_cpu_f16c(on); }, nb::arg("on"),
        "Sets cpu_f16c (JAXCOMM_CPU_F16C); off: the portable float16 kernels.");
  m.def("has_f16c_kernels", [] { return jaxcomm::cpu::HasF16c(); },
        "Whether this build and CPU have the F16C float16 combine kernels (JAXCOMM_CPU_F16C).");
  m.def("nontemporal_bytes", [] { return jaxcomm::Registry::Get().nontemporal_bytes(); },
        "Results of at least this many bytes are written with non-temporal stores (0: never).");
  m.def("set_nontemporal_bytes", [](int64_t bytes) { jaxcomm::Registry::Get().set_nontemporal_bytes(bytes); },
        nb::arg("bytes"), "Sets nontemporal_bytes (JAXCOMM_NONTEMPORAL_BYTES); 0 turns streaming stores off.");

  m.def("has_cuda", [] {
#ifdef JAXCOMM_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether this build has the CUDA backend (handlers for platform 'CUDA').");
#ifdef JAXCOMM_WITH_CUDA
  jaxcomm::cuda::RegisterCuda(m);
#endif
  jaxcomm::cuda::RegisterKernelLogic(m);

  m.def("round_counts", [] {
    auto& r = jaxcomm::Registry::Get();
    return nb::make_tuple(r.rounds_completed.load(), r.rounds_failed.load());
  }, "(completed, failed) collective rounds since start.");

  // ------------------------------------------------------------------ flight recorder

  // The dumper thread (automatic dumps) and the SIGUSR1 handler start with the module.
  jaxcomm::Registry::Get().recorder().StartDumper();

  jaxcomm::BindTraceDumps(m, jaxcomm::Registry::Get().recorder());

  m.def("trace_dir", [] { return jaxcomm::Registry::Get().recorder().dump_dir(); },
        "JAXCOMM_TRACE_DIR as read at start ('' when unset).");

  m.def("trace_entries_per_rank", [] { return jaxcomm::Registry::Get().recorder().entries_per_rank(); },
        "JAXCOMM_TRACE_ENTRIES as read at start (0: the recorder is off).");

  m.def("trace_enabled", [] { return jaxcomm::Registry::Get().recorder().enabled(); },
        "Whether calls are being recorded.");

  m.def("trace_set_enabled", [](bool on) { jaxcomm::Registry::Get().recorder().set_enabled(on); },
        "Turns recording on or off (no effect when JAXCOMM_TRACE_ENTRIES=0).");

  m.def("trace_stats", [] { return jaxcomm::TraceStatsRows(jaxcomm::Registry::Get().recorder()); },
        "Cumulative per-(instruction, group) counters of this process's rounds.");

  m.def("trace_reset_stats", [] { jaxcomm::Registry::Get().recorder().ResetStats(); },
        "Zeroes the counters behind trace_stats().");

  m.def("trace_round_cost_ns", [](int ranks, int rounds, size_t entries, const std::string& dir) {
    nb::gil_scoped_release release;
    return jaxcomm::FlightRecorder::MeasureRoundCostNs(ranks, rounds, entries, dir);
  }, nb::arg("ranks"), nb::arg("rounds"), nb::arg("entries") = 2048, nb::arg("dir") = "",
     "The recorder's CPU cost of one round of `ranks` ranks (ns), on a private recorder "
     "(its rings in a file in `dir`, or in memory when '').");

  m.def("trace_ring_file", [] { return jaxcomm::Registry::Get().recorder().RingFile(); },
        "The flight recorder's file-backed rings (JAXCOMM_TRACE_DIR), '' before the first call.");

  m.def("config_errors", [] { return jaxcomm::Registry::Get().settings().errors; },
        "The malformed JAXCOMM_* variables the runtime read at start, one message each.");

  m.def("fault_error", [] { return jaxcomm::Registry::Get().faults().error(); },
        "Why JAXCOMM_FAULT was rejected ('' when it parsed or is unset).");
}
