// The extension module: hands XLA FFI handler capsules and the state type to Python,
// which registers them (jaxcomm/_src/runtime.py). No XLA symbol is linked in: handlers
// reach XLA only through the FFI C API table passed at call time.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/registry.h"
#include "core/rendezvous.h"
#include "cpu/ft.h"
#include "cpu/handlers.h"
#include "cpu/moe_kernels.h"
#include "cpu/ragged.h"
#include "cpu/world.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

#ifdef JAXCOMM_WITH_CUDA
namespace jaxcomm::cuda {
void RegisterCuda(nb::module_& m);  // ffi/cuda/bindings.cc
}
#endif

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

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

  m.def("cpu_targets", [] {
    nb::dict targets;
    auto stages = [](XLA_FFI_Handler* execute) {
      nb::dict d;
      d["instantiate"] = Capsule(jaxcomm::cpu::kInstantiate);
      d["execute"] = Capsule(execute);
      return d;
    };
    targets["all_reduce"] = stages(jaxcomm::cpu::kAllReduce);
    targets["all_gather"] = stages(jaxcomm::cpu::kAllGather);
    targets["reduce_scatter"] = stages(jaxcomm::cpu::kReduceScatter);
    targets["all_to_all"] = stages(jaxcomm::cpu::kAllToAll);
    targets["ppermute"] = stages(jaxcomm::cpu::kPermute);
    targets["broadcast"] = stages(jaxcomm::cpu::kBroadcast);
    targets["ragged_all_to_all"] = stages(jaxcomm::cpu::kRaggedAllToAll);
    targets["moe_transport"] = stages(jaxcomm::cpu::kMoeTransport);
    targets["ft_all_reduce"] = stages(jaxcomm::cpu::kFtAllReduce);
    return targets;
  }, "Maps op name -> {stage: handler capsule} for platform 'cpu'.");

  m.def("state_type", [] {
    nb::dict d;
    d["type_id"] = nb::capsule(reinterpret_cast<void*>(&jaxcomm::InstructionState::id));
    d["type_info"] = nb::capsule(reinterpret_cast<void*>(
        const_cast<XLA_FFI_TypeInfo*>(&kInstructionStateInfo)));
    return d;
  }, "The FFI type registration of the per-instruction rendezvous state.");

  m.def("set_process_index", [](int64_t i) { jaxcomm::Registry::Get().set_process_index(i); },
        "Tells the runtime which process of the job this is (jax.process_index()).");

  m.def("transport_open", [](int64_t process, bool shared_memory) {
    std::string error;
    jaxcomm::cpu::Endpoint e;
    {
      nb::gil_scoped_release release;
      e = World().Open(process, shared_memory, &error);
    }
    if (!error.empty()) throw std::runtime_error("jaxcomm: opening this process's endpoint: " + error);
    nb::dict d;
    d["pid"] = e.pid;
    d["control_fd"] = e.control_fd;
    d["control_bytes"] = e.control_bytes;
    d["port"] = e.port;
    return d;
  }, nb::arg("process"), nb::arg("shared_memory"),
     "Creates this process's endpoint (shared memory control block, TCP listener); returns "
     "what peers need to link to it: {pid, control_fd, control_bytes, port}.");

  m.def("transport_link", [](int64_t process, const std::string& host, const std::string& label, int pid,
                             int control_fd, size_t control_bytes, int port, bool shared_memory,
                             int64_t timeout_ms) {
    jaxcomm::cpu::Endpoint e{pid, control_fd, control_bytes, port};
    std::string error;
    {
      nb::gil_scoped_release release;
      error = World().Link(process, host, label, e, shared_memory, std::chrono::milliseconds(timeout_ms));
    }
    if (!error.empty()) throw std::runtime_error("jaxcomm: linking process " + std::to_string(process) + ": " + error);
  }, nb::arg("process"), nb::arg("host"), nb::arg("label"), nb::arg("pid"), nb::arg("control_fd"),
     nb::arg("control_bytes"), nb::arg("port"), nb::arg("shared_memory"), nb::arg("timeout_ms"),
     "Links peer `process` through shared memory or TCP (idempotent).");

  m.def("excluded_processes", [] { return World().excluded(); },
        "Processes left out after they failed in a fault-tolerant collective.");

  m.def("transport_rejoin", [](uint64_t generation) {
    std::string error = World().Rejoin(generation);
    if (!error.empty()) throw std::runtime_error("jaxcomm.ft.rejoin: " + error);
  }, nb::arg("generation"), "Marks this restarted process as asking to be readmitted.");

  m.def("transport_linked", [](int64_t process) { return World().Linked(process); },
        "Whether peer `process` is linked.");

  m.def("set_spin_us", [](int64_t us) {
    jaxcomm::Registry::Get().set_spin(std::chrono::microseconds(us < 0 ? 0 : us));
  }, "How long a waiting rank spins (yielding) before it sleeps, in microseconds.");

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

  m.def("round_counts", [] {
    auto& r = jaxcomm::Registry::Get();
    return nb::make_tuple(r.rounds_completed.load(), r.rounds_failed.load());
  }, "(completed, failed) collective rounds since start.");
}
