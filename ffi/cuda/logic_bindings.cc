// The CUDA backend's host-side logic exposed to the tests: the kernels' index logic run
// on the host (logic_host.h), the copy plans and the route decision. Built into every
// extension, with or without the CUDA backend, so that CI checks it on CPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "cuda/logic_host.h"
#include "cuda/routes.h"

namespace nb = nanobind;

namespace jaxcomm::cuda {

void RegisterKernelLogic(nb::module_& m) {
  m.def("cuda_logic_route", [](const std::vector<int32_t>& ids, int64_t R, int64_t T, int64_t K,
                               int64_t E, int64_t rows, bool padded) {
    logic::Routing r = logic::RouteOnHost(ids, R, T, K, E, rows, padded);
    return std::make_tuple(r.dest, r.pos, r.sizes, r.stats);
  }, nb::arg("ids"), nb::arg("R"), nb::arg("T"), nb::arg("K"), nb::arg("E"), nb::arg("rows"),
     nb::arg("padded"),
     "The routing kernels' logic on the host: ids [R*T*K] -> (dest, pos [R*T*K], sizes "
     "[R*E/R], stats [R*3] = dropped, invalid, recv_dropped).");

  m.def("cuda_logic_moe", [](int mode, int64_t T, int64_t K, int64_t H, int64_t rows, int64_t row_bytes,
                             const std::vector<nb::bytes>& src, const std::vector<std::vector<int32_t>>& dest,
                             const std::vector<std::vector<int32_t>>& pos,
                             const std::vector<std::vector<float>>& w,
                             const std::vector<std::vector<float>>& g, int src_type, int out_type) {
    std::vector<std::string> s;
    for (const auto& b : src) s.emplace_back(b.c_str(), b.size());
    nb::list out;
    for (const auto& o : logic::MoeOnHost(mode, T, K, H, rows, row_bytes, s, dest, pos, w, g,
                                          static_cast<logic::HostFloat>(src_type),
                                          static_cast<logic::HostFloat>(out_type))) {
      out.append(nb::bytes(o.data(), o.size()));
    }
    return out;
  }, nb::arg("mode"), nb::arg("T"), nb::arg("K"), nb::arg("H"), nb::arg("rows"), nb::arg("row_bytes"),
     nb::arg("src"), nb::arg("dest"), nb::arg("pos"), nb::arg("w"), nb::arg("g"), nb::arg("src_type") = 0,
     nb::arg("out_type") = 0,
     "The MoE transport kernels' logic on the host, every rank's result (bytes); float types "
     "0 float32, 1 bfloat16, 2 float16.");

  m.def("cuda_logic_fp8_quantize", [](nb::bytes x, int type, int64_t T, int64_t H) {
    auto [q, scales] = logic::Fp8QuantizeOnHost(std::string(x.c_str(), x.size()),
                                                static_cast<logic::HostFloat>(type), T, H);
    return std::make_tuple(nb::bytes(q.data(), q.size()), scales);
  }, nb::arg("x"), nb::arg("type"), nb::arg("T"), nb::arg("H"),
     "The FP8 quantize kernel's logic on the host, lane by lane: x [T, H] bytes of type (0 "
     "float32, 1 bfloat16, 2 float16) -> (codes [T, H] bytes, scales [T * ceil(H/128)]).");

  m.def("cuda_logic_ragged", &logic::RaggedOnHost, nb::arg("mode"), nb::arg("operand"),
        nb::arg("output"), nb::arg("row_elems"), nb::arg("src_rows"), nb::arg("dst_rows"),
        nb::arg("input_offsets"), nb::arg("send_sizes"), nb::arg("output_offsets"),
        nb::arg("recv_sizes"),
        "The one-rank ragged_all_to_all kernels' logic on the host (float32 rows).");

  m.def("cuda_logic_block_copies", [](const std::vector<int64_t>& dims, int64_t axis, int64_t R,
                                      int64_t item, bool to_block, int64_t block_stride, int64_t max_pitch) {
    std::vector<std::tuple<size_t, size_t, size_t, size_t, size_t, size_t>> out;
    for (const auto& c : logic::BlockCopies(dims, axis, R, item, to_block, block_stride, max_pitch)) {
      out.emplace_back(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height);
    }
    return out;
  }, nb::arg("dims"), nb::arg("axis"), nb::arg("R"), nb::arg("item"), nb::arg("to_block"),
     nb::arg("block_stride"), nb::arg("max_pitch"),
     "The strided copies the CUDA handlers enqueue for blocks 0..R-1 of an operand split "
     "along `axis`: (dst, dpitch, src, spitch, width, height) byte offsets.");

  m.def("cuda_route", [](const std::string& op, const std::vector<std::tuple<int64_t, int64_t, std::string, std::string>>& group,
                         int64_t me, bool one_rank_nccl) {
    std::vector<Member> members;
    for (const auto& [process, ordinal, host, device] : group) members.push_back({process, ordinal, host, device});
    const RouteChoice c = ChooseRoute(op, members, me, one_rank_nccl);
    return std::make_tuple(std::string(RouteName(c.route)), c.error);
  }, nb::arg("op"), nb::arg("group"), nb::arg("me"), nb::arg("one_rank_nccl") = false,
     "The CUDA route of a group of (process, ordinal, host, device uuid) members as seen from "
     "process `me`: (route name, error or '').");
}

}  // namespace jaxcomm::cuda
