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
#include "cuda/target_bindings.h"
#include "cuda/xla_context.h"
#include "cuda_emu/runtime/emu.h"
#include "cuda_emu/seam/seam.h"
#include "cuda_emu/seam/stages.h"
#include "cuda_emu/seam/staging.h"
#include "trace_stats_bindings.h"

namespace nb = nanobind;

namespace jaxcomm::cuda {
void RegisterCuda(nb::module_& m);  // ffi/cuda/bindings.cc
}

namespace {

// _jaxcomm's host transports seen from this module's registry (its own copy of core/):
// the CUDA IPC route exchanges its handles through Registry::cross_process(), which
// bootstrap.py links in _jaxcomm's registry. Both modules compile core/cross_process.h
// with the same compiler and flags, so the virtual calls cross between them; the World
// lives as long as the process (Registry is never destroyed).
class BorrowedCrossProcess final : public jaxcomm::CrossProcess {
 public:
  explicit BorrowedCrossProcess(jaxcomm::CrossProcess* world) : world_(world) {}
  void Exchange(jaxcomm::ExchangeSpec spec, jaxcomm::ExchangeDone done) override {
    world_->Exchange(std::move(spec), std::move(done));
  }
  void Release(const jaxcomm::ExchangePlan& plan, int64_t seq) override { world_->Release(plan, seq); }
  bool Linked(int64_t p) const override { return world_->Linked(p); }
  bool CanStream(const std::vector<int64_t>& peers) const override { return world_->CanStream(peers); }
  bool CanReadDirectly(const std::vector<int64_t>& peers) const override { return world_->CanReadDirectly(peers); }
  std::string Stream(const jaxcomm::StreamSpec& spec, const jaxcomm::StreamConsume& consume,
                     bool* timed_out) override {
    return world_->Stream(spec, consume, timed_out);
  }
  std::string HostOf(int64_t p) const override { return world_->HostOf(p); }
  const jaxcomm::LinkCapabilities* LinkOf(int64_t p) const override { return world_->LinkOf(p); }
  std::unique_ptr<jaxcomm::InlineExchange> OpenInline(std::shared_ptr<const jaxcomm::ExchangePlan> plan,
                                                      size_t my_bytes) override {
    return world_->OpenInline(std::move(plan), my_bytes);
  }

 private:
  jaxcomm::CrossProcess* world_;
};

}  // namespace

NB_MODULE(_jaxcomm_emu, m) {
  m.doc() = "jaxcomm's CUDA backend on the emulated CUDA runtime (CPU only)";
  jaxcomm::cuda::RegisterCuda(m);

  // In place of bindings.cc's cuda_targets (which XLA:CPU would run without initialize).
  m.def("emu_cuda_targets", [] { return jaxcomm::cuda::StagesDict(jaxcomm::cuda_emu::EmulatedStages()); }, "Maps op name -> {stage: capsule} for XLA:CPU: each execute stage runs the op's "
     "initialize stage first (XLA:CPU runs none).");

  m.def("emu_cuda_local_targets", [] {
    return jaxcomm::cuda::LocalTargetsDict(jaxcomm::cuda_emu::EmulatedLocalTargets());
  }, "Maps op name -> {'execute': capsule} of the kernels called outside any group, their "
     "buffers staged in emulated device memory as the groups' are.");

  m.def("emu_set_local_devices", [](std::vector<int64_t> ids) { jaxcomm::cuda_emu::SetLocalDevices(std::move(ids)); },
        nb::arg("xla_ids"), "XLA:CPU's ids of this process's devices, device k being emulated GPU k.");

  m.def("emu_borrow_cross_process", [](nb::capsule world) {
    auto* w = static_cast<jaxcomm::CrossProcess*>(world.data());
    if (jaxcomm::Registry::Get().cross_process() == nullptr) {
      jaxcomm::Registry::Get().set_cross_process(std::make_unique<BorrowedCrossProcess>(w));
    }
  }, nb::arg("world"), "Makes _jaxcomm's host transports (cross_process_capsule()) this module's.");

  m.def("emu_seam_stats", [] {
    const jaxcomm::cuda_emu::seam::StagingStats s = jaxcomm::cuda_emu::seam::Stats();
    nb::dict d;
    d["calls"] = s.calls;
    d["buffers"] = s.buffers;
    d["bytes_in"] = s.bytes_in;
    d["bytes_out"] = s.bytes_out;
    d["arena_bytes"] = s.arena_bytes;
    d["arenas"] = s.arenas;
    d["pinned"] = s.pinned;
    nb::list last;
    for (const auto& b : s.last_call) {
      nb::dict e;
      e["xla"] = b.xla;
      e["staged"] = b.staged;
      e["bytes"] = b.bytes;
      e["device_memory"] = b.device_memory;
      e["result"] = b.result;
      last.append(e);
    }
    d["last_call"] = last;
    return d;
  }, "The XLA seam's staging of XLA:CPU's buffers in emulated device memory: counters, the "
     "per-device arenas, and the last call's buffers ({xla, staged, bytes, device_memory, result}).");

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
