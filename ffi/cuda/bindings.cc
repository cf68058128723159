// The CUDA part of the extension module (ffi/module.cc calls RegisterCuda): handler
// capsules for platform "CUDA", NCCL set-up, what the job's processes publish, statistics,
// the loopback entry point, and test hooks that exercise the host side on CPU. Nothing
// here touches the GPU or NCCL until Python asks.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda/backend.h"
#include "cuda/handlers.h"
#include "cuda/loopback.h"
#include "cuda/nccl.h"
#include "cuda/peers.h"
#include "cuda/process_exchange.h"
#include "cuda/state.h"
#include "cuda/target_bindings.h"
#include "cuda/xla_context.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jaxcomm::cuda {
namespace {

namespace ffi = xla::ffi;

const XLA_FFI_TypeInfo kCudaStateInfo = xla::ffi::MakeTypeInfo<CudaState>();

nb::capsule Capsule(XLA_FFI_Handler* fn) { return nb::capsule(reinterpret_cast<void*>(fn)); }

template <typename T>
nb::bytes Bytes(const std::vector<T>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

const NcclApi& Nccl() {
  std::string error;
  const NcclApi* api = NcclApi::Get(&error);
  if (api == nullptr) throw std::runtime_error(error);
  return *api;
}

// The attribute probe's execute stage (tests only): reports what the CUDA instantiate
// stage parsed, as its error, without touching a device.
ffi::Error ProbeExecute(CudaState* st, ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error(ffi::ErrorCode::kCancelled, "jaxcomm CUDA attribute probe: " + st->Summary());
}

// An XLA FFI API whose scratch allocator keeps XLA:GPU's contract (xla_context.h's
// ScratchAlignmentRefusal) on host memory: the scratch probe runs DeviceScratch, the
// handlers' own allocation code, against it.
struct FakeError {
  std::string message;
};
constexpr size_t kFakeScratchCapacity = size_t{1} << 30;
XLA_FFI_Error* FakeAllocate(XLA_FFI_DeviceMemory_Allocate_Args* args) {
  if (std::string why = ScratchAlignmentRefusal(args->alignment); !why.empty()) {
    return reinterpret_cast<XLA_FFI_Error*>(new FakeError{"INVALID_ARGUMENT: " + why});
  }
  if (args->size > kFakeScratchCapacity) {
    return reinterpret_cast<XLA_FFI_Error*>(new FakeError{"RESOURCE_EXHAUSTED: out of memory"});
  }
  // As XLA's device allocators: no memory (and no error) for 0 bytes.
  args->data = args->size == 0 ? nullptr : std::aligned_alloc(256, (args->size + 255) / 256 * 256);
  return nullptr;
}
XLA_FFI_Error* FakeFree(XLA_FFI_DeviceMemory_Free_Args* args) {
  std::free(args->data);
  return nullptr;
}
void FakeMessage(XLA_FFI_Error_GetMessage_Args* args) {
  args->message = reinterpret_cast<FakeError*>(args->error)->message.c_str();
}
void FakeDestroy(XLA_FFI_Error_Destroy_Args* args) { delete reinterpret_cast<FakeError*>(args->error); }

const XLA_FFI_Api* FakeScratchApi() {
  static const XLA_FFI_Api api = [] {
    XLA_FFI_Api a{};
    a.XLA_FFI_DeviceMemory_Allocate = FakeAllocate;
    a.XLA_FFI_DeviceMemory_Free = FakeFree;
    a.XLA_FFI_Error_GetMessage = FakeMessage;
    a.XLA_FFI_Error_Destroy = FakeDestroy;
    return a;
  }();
  return &api;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxcomm_cuda_ProbeExecute, ProbeExecute,
                              ffi::Ffi::Bind().Ctx<ffi::State<CudaState>>().RemainingArgs().RemainingRets());

nb::dict StagesDict(const Stages* stages) {
  nb::dict targets;
  for (const Stages* s = stages; s->op != nullptr; ++s) {
    nb::dict d;
    if (s->instantiate != nullptr) d["instantiate"] = Capsule(s->instantiate);
    if (s->initialize != nullptr) d["initialize"] = Capsule(s->initialize);
    if (s->execute != nullptr) d["execute"] = Capsule(s->execute);
    targets[s->op] = d;
  }
  return targets;
}

nb::dict LocalTargetsDict(const LocalTarget* targets) {
  nb::dict out;
  for (const LocalTarget* t = targets; t->op != nullptr; ++t) {
    nb::dict d;
    d["execute"] = Capsule(t->execute);
    out[t->op] = d;
  }
  return out;
}

void RegisterCuda(nb::module_& m) {
  m.def("cuda_targets", [] { return StagesDict(AllStages()); }, "Maps op name -> {stage: handler capsule} for platform CUDA (registered without traits).");

  m.def("cuda_local_targets", [] { return LocalTargetsDict(LocalTargets()); }, "Maps op name -> {'execute': capsule} of the CUDA kernels called outside any group "
     "(no state; registered without traits).");

  m.def("cuda_state_type", [] {
    nb::dict d;
    d["type_id"] = nb::capsule(reinterpret_cast<void*>(&CudaState::id));
    d["type_info"] = nb::capsule(reinterpret_cast<void*>(const_cast<XLA_FFI_TypeInfo*>(&kCudaStateInfo)));
    return d;
  }, "The FFI type registration of the CUDA handlers' per-instruction state.");

  m.def("cuda_scratch_alignment", [] { return nb::make_tuple(kScratchAlignment, kXlaMaxScratchAlignment); },
        "(alignment the CUDA handlers ask XLA's scratch allocator for, the most XLA accepts).");

  m.def("cuda_scratch_probe", [](size_t bytes) {
    DeviceScratch scratch(FakeScratchApi(), nullptr);
    std::string error;
    void* p = scratch.Allocate(bytes, &error);
    return nb::make_tuple(error, reinterpret_cast<uintptr_t>(p));
  }, nb::arg("bytes"),
     "Allocates `bytes` through the handlers' scratch code from an allocator with XLA:GPU's "
     "alignment contract (on host memory, at most 1 GiB): (error, address); tests only.");

  m.def("cuda_versions", [] {
    int runtime = 0, driver = 0;
    nb::dict d;
    d["built"] = CUDART_VERSION;
    d["runtime"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess ? runtime : 0;
    d["driver"] = cudaDriverGetVersion(&driver) == cudaSuccess ? driver : 0;
    return d;
  }, "{'built': CUDART_VERSION, 'runtime': cudaRuntimeGetVersion, 'driver': cudaDriverGetVersion "
     "(0: no driver)}, as 1000 * major + 10 * minor.");

  m.def("cuda_device_count", [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  }, "CUDA devices this process sees (0 when there is no driver or GPU).");

  m.def("cuda_device_uuid", [](int ordinal) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, ordinal) != cudaSuccess) return std::string();
    static const char* hex = "0123456789abcdef";
    std::string s;
    for (unsigned char b : prop.uuid.bytes) {
      s += hex[b >> 4];
      s += hex[b & 15];
    }
    return s;
  }, nb::arg("ordinal"), "The UUID of local CUDA device `ordinal` (hex), '' without one.");

  m.def("cuda_set_process_info", [](int64_t process, std::string host, std::vector<std::string> devices) {
    Backend::Get().processes().Set(process, std::move(host), std::move(devices));
  }, nb::arg("process"), nb::arg("host"), nb::arg("devices"),
     "What process `process` published: its host key and its devices' UUIDs by local ordinal.");

  m.def("cuda_set_nccl_path", [](std::string path) { NcclApi::SetSearchPath(std::move(path)); },
        "The libnccl.so.2 to try first (the nvidia-nccl wheel's), before NCCL is loaded.");

  m.def("cuda_nccl_version", [] { return Nccl().version; },
        "Loads NCCL if needed and returns its version code (e.g. 22803); raises when absent.");

  m.def("cuda_nccl_path", [] { return Nccl().path; }, "The NCCL library that was loaded.");

  m.def("cuda_nccl_unique_id", [] {
    const NcclApi& api = Nccl();
    ncclUniqueId id;
    const ncclResult_t r = api.GetUniqueId(&id);
    if (r != ncclSuccess) throw std::runtime_error("ncclGetUniqueId failed: " + api.Describe(r, nullptr));
    return nb::bytes(id.internal, sizeof(id.internal));
  }, "A fresh NCCL unique id (bytes) for a group whose rank 0 lives in this process.");

  m.def("cuda_set_unique_id", [](const std::string& key, nb::bytes id) {
    ncclUniqueId u;
    if (id.size() != sizeof(u.internal)) throw std::invalid_argument("an NCCL unique id has 128 bytes");
    std::memcpy(u.internal, id.c_str(), sizeof(u.internal));
    Backend::Get().comms().SetUniqueId(key, u);
  }, "Sets the NCCL unique id of a group spanning processes (from the key-value store).");

  m.def("cuda_communicators", [] {
    nb::list out;
    for (const auto& s : Backend::Get().comms().List()) {
      nb::dict d;
      d["group"] = s.key;
      d["rank"] = s.rank;
      d["size"] = s.size;
      d["create_ms"] = s.create_ms;
      d["memory_bytes"] = s.memory_bytes;
      d["failure"] = s.failure;
      out.append(d);
    }
    return out;
  }, "The NCCL communicators created so far: creation time, device memory, why aborted ('').");

  m.def("cuda_watched_calls", [] { return Backend::Get().watcher().pending(); },
        "Calls the completion watcher still waits for (tests).");

  // ------------------------------------------------------------------ test hooks (CPU)

  m.def("cuda_attr_probe_targets", [] {
    nb::dict targets;
    for (const Stages* s = AllStages(); s->op != nullptr; ++s) {
      nb::dict d;
      d["instantiate"] = Capsule(s->instantiate);
      d["execute"] = Capsule(jaxcomm_cuda_ProbeExecute);
      targets[s->op] = d;
    }
    return targets;
  }, "Tests: the CUDA instantiate stages with an execute stage that reports what they parsed "
     "(its error message), for registration on platform 'cpu'.");

  m.def("cuda_test_peer_rounds", [](int ranks, int iterations, int64_t timeout_ms, int absent) {
    // Ranks on threads run `iterations` calls of one instruction back to back, rank 0
    // racing ahead, as a loop body does (rank `absent` never comes); returns the errors.
    std::vector<std::string> errors(ranks);
    {
      nb::gil_scoped_release release;
      LocalPeers peers;
      std::vector<int64_t> group(ranks);
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r) {
        if (r == absent) continue;
        threads.emplace_back([&, r] {
          CallContext ctx;
          ctx.op = "test";
          ctx.group = &group;
          ctx.rank = r;
          for (int i = 1; i <= iterations && errors[r].empty(); ++i) {
            if (r != 0) std::this_thread::sleep_for(std::chrono::microseconds(50 * r));
            PeerInfo mine;
            mine.ptr[0] = reinterpret_cast<const void*>(static_cast<uintptr_t>(1000 * i + r));
            const PeerCallKey key{7, i, 0};
            auto all = peers.Exchange(key, r, ranks, mine, std::chrono::milliseconds(timeout_ms), ctx);
            if (all.has_error()) {
              errors[r] = all.error().message();
              break;
            }
            for (int d = 0; d < ranks; ++d) {
              if ((*all)[d].ptr[0] != reinterpret_cast<const void*>(static_cast<uintptr_t>(1000 * i + d))) {
                errors[r] = "iteration " + std::to_string(i) + " met another iteration's buffers";
              }
            }
            ffi::Error e = peers.Finish(key, r, std::chrono::milliseconds(timeout_ms), ctx);
            if (e.failure()) errors[r] = e.message();
          }
        });
      }
      for (auto& t : threads) t.join();
    }
    return errors;
  }, nb::arg("ranks"), nb::arg("iterations"), nb::arg("timeout_ms"), nb::arg("absent") = -1,
     "Tests: in-process peer rounds of a loop body (see peers.h); every rank's error, '' if none.");

  m.def("cuda_test_nccl_call", [](const std::string& behaviour, int64_t timeout_ms) {
    // One NCCL call through Communicator::Run against a fake NCCL (no GPU, no library):
    // "hang" stays in progress, "error" fails, "slow" finishes after a few polls. Returns
    // (the call's error, whether the communicator was aborted, a second call's error).
    static std::atomic<int> polls{0}, aborts{0};
    static std::string mode;
    polls = 0;
    aborts = 0;
    mode = behaviour;
    NcclApi api;
    api.CommGetAsyncError = [](ncclComm_t, ncclResult_t* state) {
      *state = mode == "slow" && ++polls > 3 ? ncclSuccess : ncclInProgress;
      return ncclSuccess;
    };
    api.CommAbort = [](ncclComm_t) {
      ++aborts;
      return ncclSuccess;
    };
    api.CommDestroy = [](ncclComm_t) { return ncclSuccess; };
    api.GetErrorString = [](ncclResult_t) { return "fake NCCL error"; };
    std::vector<int64_t> group = {4, 5};
    CallContext ctx;
    ctx.op = "all_reduce";
    ctx.axis = "x";
    ctx.call_site = "test.py:1";
    ctx.group = &group;
    ctx.rank = 1;
    ctx.partition = 5;
    ctx.execution = 3;
    Communicator comm(&api, reinterpret_cast<ncclComm_t>(&api), "nccl:0/0,1/0", 1, 2, 0, 0);
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    auto call = [&](ncclComm_t) { return mode == "error" ? ncclSystemError : ncclInProgress; };
    ffi::Error first = comm.Run(ctx, "ncclAllReduce", call, deadline);
    ffi::Error second = comm.Run(ctx, "ncclAllReduce", call, deadline);
    return nb::make_tuple(first.message(), aborts.load() > 0, second.message());
  }, nb::arg("behaviour"), nb::arg("timeout_ms"),
     "Tests: an NCCL call's deadline and abort (nccl_comm.h) against a fake NCCL.");

  m.def("cuda_test_exchange_records", [](uint64_t key, int64_t seq, std::vector<int64_t> peers,
                                         nb::bytes mine, int64_t timeout_ms) {
    std::vector<std::string> desc;
    for (int64_t p : peers) desc.push_back("process " + std::to_string(p));
    const std::string record(mine.c_str(), mine.size());
    std::vector<std::string> theirs;
    bool timed_out = false;
    std::string error;
    {
      nb::gil_scoped_release release;
      error = ExchangeRecords(MakePlan(key, peers, record.size(), desc), seq, record,
                              std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms),
                              &theirs, &timed_out);
    }
    if (!error.empty()) throw std::runtime_error((timed_out ? "timed out: " : "") + error);
    nb::list out;
    for (const auto& t : theirs) out.append(nb::bytes(t.data(), t.size()));
    return out;
  }, nb::arg("key"), nb::arg("seq"), nb::arg("peers"), nb::arg("mine"), nb::arg("timeout_ms"),
     "Tests: one round of the records exchange the CUDA IPC route uses (process_exchange.h).");

  m.def("cuda_moe_loopback",
        [](nb::bytes x, nb::bytes ids, nb::bytes w, int R, int64_t T, int64_t H, int64_t K,
           int64_t E, int64_t capacity, bool padded, bool bf16, int iters, bool return_expert_x,
           int device, bool per_rank, bool f16, bool low_latency, bool fp8) {
          LoopbackConfig cfg;
          cfg.device = device;
          cfg.R = R;
          cfg.T = T;
          cfg.H = H;
          cfg.K = K;
          cfg.E = E;
          cfg.capacity = capacity;
          cfg.padded = padded;
          cfg.bf16 = bf16;
          cfg.iters = iters;
          cfg.return_expert_x = return_expert_x;
          cfg.per_rank = per_rank;
          cfg.f16 = f16;
          cfg.low_latency = low_latency;
          cfg.fp8 = fp8;
          const size_t item = bf16 || f16 ? 2 : 4;
          if (x.size() != R * T * H * item || ids.size() != R * T * K * 4 || w.size() != R * T * K * 4) {
            throw std::invalid_argument("cuda_moe_loopback: x, ids or w has the wrong size");
          }
          LoopbackResult r;
          std::string err;
          {
            nb::gil_scoped_release release;
            err = RunMoeLoopback(cfg, x.c_str(), reinterpret_cast<const int32_t*>(ids.c_str()),
                                 reinterpret_cast<const float*>(w.c_str()), &r);
          }
          if (!err.empty()) throw std::runtime_error(err);
          nb::dict d;
          d["y"] = Bytes(r.y);
          d["expert_x"] = Bytes(r.expert_x);
          d["sizes"] = Bytes(r.sizes);
          d["stats"] = Bytes(r.stats);
          d["dest"] = Bytes(r.dest);
          d["pos"] = Bytes(r.pos);
          d["plan_ms"] = r.plan_ms;
          d["dispatch_ms"] = r.dispatch_ms;
          d["combine_ms"] = r.combine_ms;
          d["memcpy_ms"] = r.memcpy_ms;
          d["memcpy_bytes"] = r.memcpy_bytes;
          d["pairs"] = r.pairs;
          d["rows"] = r.rows;
          return d;
        },
        nb::arg("x"), nb::arg("ids"), nb::arg("w"), nb::arg("R"), nb::arg("T"), nb::arg("H"),
        nb::arg("K"), nb::arg("E"), nb::arg("capacity"), nb::arg("padded"), nb::arg("bf16"),
        nb::arg("iters"), nb::arg("return_expert_x"), nb::arg("device") = 0, nb::arg("per_rank") = false,
        nb::arg("f16") = false, nb::arg("low_latency") = false, nb::arg("fp8") = false,
        "Runs MoE routing, dispatch and combine for R logical ranks on one GPU (see "
        "ffi/cuda/loopback.h); raw little-endian bytes in and out.");
}

}  // namespace jaxcomm::cuda
