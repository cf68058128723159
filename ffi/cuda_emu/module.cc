// _jaxcomm_emu: the CUDA backend (ffi/cuda/, the same sources as the GPU build) compiled
// against the emulated CUDA runtime (ffi/cuda_emu/runtime/) and its kernels against the
// SIMT layer (ffi/cuda_emu/simt/), for XLA:CPU (JAXCOMM_EMULATE_CUDA=1; docs/cuda.md).
//
// A module of its own, beside _jaxcomm: the real CUDA backend may be built into _jaxcomm
// with the same symbols. It therefore has its own copy of core/ (registry, flight
// recorder): its calls' statistics are this module's trace_stats(), which jaxcomm.stats()
// adds to the host backend's.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "core/registry.h"
#include "cuda/xla_context.h"
#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/seam/seam.h"
#include "cuda_emu/seam/stages.h"
#include "trace_stats_bindings.h"

namespace nb = nanobind;

namespace jaxcomm::cuda {
void RegisterCuda(nb::module_& m);  // ffi/cuda/bindings.cc
}

NB_MODULE(_jaxcomm_emu, m) {
  m.doc() = "jaxcomm's CUDA backend on the emulated CUDA runtime (CPU only)";
  jaxcomm::cuda::RegisterCuda(m);

  // In place of bindings.cc's cuda_targets (which XLA:CPU would run without initialize).
  m.def("emu_cuda_targets", [] {
    nb::dict targets;
    for (const jaxcomm::cuda::Stages* s = jaxcomm::cuda_emu::EmulatedStages(); s->op != nullptr; ++s) {
      nb::dict d;
      d["instantiate"] = nb::capsule(reinterpret_cast<void*>(s->instantiate));
      d["execute"] = nb::capsule(reinterpret_cast<void*>(s->execute));
      targets[s->op] = d;
    }
    return targets;
  }, "Maps op name -> {stage: capsule} for XLA:CPU: each execute stage runs the op's "
     "initialize stage first (XLA:CPU runs none).");

  m.def("emu_device_count", [] { return jaxcomm::cuda_emu::DeviceCount(); },
        "Devices the emulated runtime has.");
  m.def("emu_strict_violations", [] { return jaxcomm::cuda_emu::TakeStrictViolations(); },
        "Takes the strict checks' reports so far (misuse of the CUDA API).");
  m.def("emu_set_strict", [](bool on) { jaxcomm::cuda_emu::SetStrict(on); }, nb::arg("on"),
        "Turns the strict checks on or off (they are on by default).");
  m.def("emu_sticky_error", [] { return jaxcomm::cuda_emu::StickyErrorWhy(); },
        "Why the emulated context holds a sticky error ('' if it does not).");

  m.def("emu_scratch_probe", [](size_t bytes, size_t alignment) {
    std::string error;
    void* p = jaxcomm::cuda_emu::seam::AllocateScratch(0, bytes, alignment, &error);
    const uintptr_t address = reinterpret_cast<uintptr_t>(p);
    if (p != nullptr) cudaFree(p);
    return nb::make_tuple(error, address);
  }, nb::arg("bytes"), nb::arg("alignment") = jaxcomm::cuda::kScratchAlignment,
     "Allocates and frees scratch through the emulated XLA seam: (XLA's refusal or '', address).");

  // The same as _jaxcomm's (ffi/module.cc), over this module's flight recorder: its files
  // are named apart from _jaxcomm's in one directory (FlightRecorder::set_tag), its dumper
  // thread dumps on a timeout (JAXCOMM_TRACE_DIR), and SIGUSR1 stays _jaxcomm's.
  jaxcomm::Registry::Get().recorder().set_tag("cuda-emu");
  jaxcomm::Registry::Get().recorder().StartDumper(/*handle_signal=*/false);
  jaxcomm::BindTraceDumps(m, jaxcomm::Registry::Get().recorder());
  m.def("trace_stats", [] { return jaxcomm::TraceStatsRows(jaxcomm::Registry::Get().recorder()); },
        "Cumulative per-(instruction, group) counters of the emulated CUDA calls.");
  m.def("trace_reset_stats", [] { jaxcomm::Registry::Get().recorder().ResetStats(); },
        "Zeroes the counters behind trace_stats().");
  m.def("set_process_index", [](int64_t i) { jaxcomm::Registry::Get().set_process_index(i); },
        nb::arg("index"), "This process's index in the job (jax.process_index()).");
}
