// The CUDA part of the extension module (ffi/module.cc calls RegisterCuda): handler
// capsules for platform "CUDA", NCCL set-up, communicator statistics and the loopback
// entry point. Nothing here touches the GPU or NCCL until Python asks.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>

#include "cuda/comms.h"
#include "cuda/handlers.h"
#include "cuda/loopback.h"
#include "cuda/nccl.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jaxcomm::cuda {
namespace {

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

}  // namespace

void RegisterCuda(nb::module_& m) {
  m.def("cuda_targets", [] {
    nb::dict targets;
    for (const Stages* s = AllStages(); s->op != nullptr; ++s) {
      nb::dict d;
      d["instantiate"] = Capsule(s->instantiate);
      d["initialize"] = Capsule(s->initialize);
      d["execute"] = Capsule(s->execute);
      targets[s->op] = nb::make_tuple(d, s->command_buffer_compatible);
    }
    return targets;
  }, "Maps op name -> ({stage: handler capsule}, command-buffer compatible) for platform CUDA.");

  m.def("cuda_state_type", [] {
    nb::dict d;
    d["type_id"] = nb::capsule(reinterpret_cast<void*>(&CudaState::id));
    d["type_info"] = nb::capsule(reinterpret_cast<void*>(const_cast<XLA_FFI_TypeInfo*>(&kCudaStateInfo)));
    return d;
  }, "The FFI type registration of the CUDA handlers' per-instruction state.");

  m.def("cuda_device_count", [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  }, "CUDA devices this process sees (0 when there is no driver or GPU).");

  m.def("cuda_set_nccl_path", [](std::string path) { NcclApi::SetSearchPath(std::move(path)); },
        "The libnccl.so.2 to try first (the nvidia-nccl-cu13 wheel's), before NCCL is loaded.");

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
    CommRegistry::Get().SetUniqueId(key, u);
  }, "Sets the NCCL unique id of a group spanning processes (from the key-value store).");

  m.def("cuda_communicators", [] {
    nb::list out;
    for (const auto& s : CommRegistry::Get().List()) {
      nb::dict d;
      d["group"] = s.key;
      d["rank"] = s.rank;
      d["size"] = s.size;
      d["create_ms"] = s.create_ms;
      d["memory_bytes"] = s.memory_bytes;
      out.append(d);
    }
    return out;
  }, "The NCCL communicators created so far, with creation time and device memory each.");

  m.def("cuda_moe_loopback",
        [](nb::bytes x, nb::bytes ids, nb::bytes w, int R, int64_t T, int64_t H, int64_t K,
           int64_t E, int64_t capacity, bool padded, bool bf16, int iters, bool return_expert_x,
           int device, bool per_rank) {
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
          const size_t item = bf16 ? 2 : 4;
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
        "Runs MoE routing, dispatch and combine for R logical ranks on one GPU (see "
        "ffi/cuda/loopback.h); raw little-endian bytes in and out.");
}

}  // namespace jaxcomm::cuda
