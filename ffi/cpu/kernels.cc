#include "cpu/kernels.h"

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstring>
#include <type_traits>

#include "core/number_formats.h"
#include "cpu/cpu_clones.h"
#include "cpu/result_stores.h"

namespace jaxcomm::cpu {

namespace ffi = xla::ffi;

namespace {

// Half precision as its 16 bits (a type of its own, apart from uint16_t), summed in
// float32 and rounded once (to nearest even, NaN kept quiet) by its element tag's
// branch-free conversions (core/number_formats.h): loops the compiler vectorises. (A
// `_Float16` cast is a library call per element in GCC 12 without F16C: a float16
// all_reduce took 1.8x XLA's time.)
template <typename Tag>
struct Half {
  uint16_t bits;
};
using BF16 = Half<BF16T>;
using F16 = Half<F16T>;

template <typename T>
struct Acc {
  using type = T;
  static type Load(T v) { return v; }
  static T Store(type v) { return v; }
};
template <typename Tag>
struct Acc<Half<Tag>> {
  using type = float;
  static float Load(Half<Tag> v) { return Tag::Load(v.bits); }
  static Half<Tag> Store(float v) { return Half<Tag>{Tag::Store(v)}; }
};

// Whether T is summed in a wider type (half precision in float32): its loops convert every
// element, and get the AVX2 build too (the *Widened kernels below).
template <typename T>
constexpr bool kWidened = !std::is_same_v<typename Acc<T>::type, T>;

template <typename A>
constexpr bool kIsFloating = std::is_floating_point_v<A>;

template <typename A>
struct SumOp {
  static A Apply(A a, A b) { return a + b; }
};
template <typename A>
struct ProdOp {
  static A Apply(A a, A b) { return a * b; }
};
// min/max propagate NaN, as XLA's do.
template <typename A>
struct MinOp {
  static A Apply(A a, A b) {
    if constexpr (kIsFloating<A>) {
      if (std::isnan(b)) return b;
    }
    return b < a ? b : a;
  }
};
template <typename A>
struct MaxOp {
  static A Apply(A a, A b) {
    if constexpr (kIsFloating<A>) {
      if (std::isnan(b)) return b;
    }
    return a < b ? b : a;
  }
};

// All inputs at once per element, the accumulator in a register (float32 for half
// precision, rounded once): one pass over the inputs instead of one per input over an L1
// block (reduce_scatter of 16 MiB over 8 ranks: ~2x faster). Same order as below:
// ((x0 op x1) op x2) ...
template <typename T, template <typename> class Op, int N>
__attribute__((always_inline)) inline void ReduceFixedLoop(const std::vector<const void*>& inputs, size_t offset,
                                                           T* out, size_t n) {
  using A = typename Acc<T>::type;
  const T* in[N];
  for (int j = 0; j < N; ++j) in[j] = static_cast<const T*>(inputs[j]) + offset;
  for (size_t i = 0; i < n; ++i) {
    A a = Acc<T>::Load(in[0][i]);
    for (int j = 1; j < N; ++j) a = Op<A>::Apply(a, Acc<T>::Load(in[j][i]));
    out[i] = Acc<T>::Store(a);
  }
}

template <typename T, template <typename> class Op, int N>
void ReduceFixed(const std::vector<const void*>& inputs, size_t offset, T* out, size_t n) {
  ReduceFixedLoop<T, Op, N>(inputs, offset, out, n);
}

// Half precision: its conversions are integer and select operations per lane, which the
// AVX2 build (cpu/cpu_clones.h) runs eight lanes at a time.
template <typename T, template <typename> class Op, int N>
JAXCOMM_ROW_KERNEL void ReduceFixedWidened(const std::vector<const void*>& inputs, size_t offset, T* out,
                                           size_t n) {
  ReduceFixedLoop<T, Op, N>(inputs, offset, out, n);
}

template <typename T, template <typename> class Op, int N>
constexpr auto kReduceFixed = kWidened<T> ? ReduceFixedWidened<T, Op, N> : ReduceFixed<T, Op, N>;

template <typename T, template <typename> class Op>
bool ReduceRegister(const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                    size_t begin, size_t end, bool streaming) {
  void (*reduce)(const std::vector<const void*>&, size_t, T*, size_t);
  switch (inputs.size()) {
    case 2: reduce = kReduceFixed<T, Op, 2>; break;
    case 3: reduce = kReduceFixed<T, Op, 3>; break;
    case 4: reduce = kReduceFixed<T, Op, 4>; break;
    case 8: reduce = kReduceFixed<T, Op, 8>; break;
    default: return false;
  }
  // Streaming: reduced into a block that stays in L1, which then streams to every
  // output. Else into outputs[0], in blocks that stay in L2 while they are copied to the
  // other outputs (StoreResult skips outputs[0] itself).
  constexpr size_t kStage = 16 * 1024 / sizeof(T) ? 16 * 1024 / sizeof(T) : 1;
  constexpr size_t kBlock = 64 * 1024 / sizeof(T) ? 64 * 1024 / sizeof(T) : 1;
  alignas(64) T stage[kStage];
  const size_t block = streaming ? kStage : kBlock;
  for (size_t b = begin; b < end; b += block) {
    const size_t n = std::min(end - b, block);
    T* reduced = streaming ? stage : static_cast<T*>(outputs[0]) + b;
    reduce(inputs, b, reduced, n);
    for (void* out : outputs) StoreResult(static_cast<T*>(out) + b, reduced, n * sizeof(T), streaming);
  }
  return true;
}

// Input by input over blocks of elements whose accumulator stays in L1, in A (float32
// for half precision), rounded once into T.
template <typename T, template <typename> class Op>
__attribute__((always_inline)) inline void ReduceBlocks(const std::vector<const void*>& inputs,
                                                        const std::vector<void*>& outputs, size_t begin,
                                                        size_t end, bool streaming) {
  using A = typename Acc<T>::type;
  constexpr size_t kBlock = 2048;
  A acc[kBlock];
  T rounded[kWidened<T> ? kBlock : 1];
  const size_t n_in = inputs.size();
  for (size_t b = begin; b < end; b += kBlock) {
    const size_t n = std::min(kBlock, end - b);
    const T* s0 = static_cast<const T*>(inputs[0]) + b;
    for (size_t i = 0; i < n; ++i) acc[i] = Acc<T>::Load(s0[i]);
    for (size_t j = 1; j < n_in; ++j) {
      const T* s = static_cast<const T*>(inputs[j]) + b;
      for (size_t i = 0; i < n; ++i) acc[i] = Op<A>::Apply(acc[i], Acc<T>::Load(s[i]));
    }
    const T* block;
    if constexpr (!kWidened<T>) {
      block = acc;
    } else {
      for (size_t i = 0; i < n; ++i) rounded[i] = Acc<T>::Store(acc[i]);
      block = rounded;
    }
    for (void* out : outputs) StoreResult(static_cast<T*>(out) + b, block, n * sizeof(T), streaming);
  }
}

// Half precision over groups of other sizes than ReduceRegister's, built for AVX2 too.
template <typename T, template <typename> class Op>
JAXCOMM_ROW_KERNEL void ReduceWidened(const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                                      size_t begin, size_t end, bool streaming) {
  ReduceBlocks<T, Op>(inputs, outputs, begin, end, streaming);
}

template <typename T, template <typename> class Op>
void ReduceTyped(const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                 size_t begin, size_t end, bool streaming) {
  // Each element of outputs[0] is written after every input's element was read, and the
  // other outputs are written after the whole range: safe for in-place calls.
  if (ReduceRegister<T, Op>(inputs, outputs, begin, end, streaming)) return;
  if constexpr (kWidened<T>) {
    ReduceWidened<T, Op>(inputs, outputs, begin, end, streaming);
  } else {
    ReduceBlocks<T, Op>(inputs, outputs, begin, end, streaming);
  }
}

template <typename T>
bool DispatchOp(ReduceOp op, const std::vector<const void*>& in, const std::vector<void*>& out,
                size_t begin, size_t end, bool run, bool streaming) {
  constexpr bool ordered = !std::is_same_v<T, std::complex<float>> &&
                           !std::is_same_v<T, std::complex<double>>;
  switch (op) {
    case ReduceOp::kSum:
      if (run) ReduceTyped<T, SumOp>(in, out, begin, end, streaming);
      return true;
    case ReduceOp::kProd:
      if (run) ReduceTyped<T, ProdOp>(in, out, begin, end, streaming);
      return true;
    case ReduceOp::kMin:
      if constexpr (ordered) {
        if (run) ReduceTyped<T, MinOp>(in, out, begin, end, streaming);
        return true;
      }
      return false;
    case ReduceOp::kMax:
      if constexpr (ordered) {
        if (run) ReduceTyped<T, MaxOp>(in, out, begin, end, streaming);
        return true;
      }
      return false;
  }
  return false;
}

bool Dispatch(ffi::DataType dtype, ReduceOp op, const std::vector<const void*>& in,
              const std::vector<void*>& out, size_t begin, size_t end, bool run, bool streaming) {
  switch (dtype) {
    case ffi::DataType::PRED:  // min/max/prod of 0/1 bytes: and/or
      return op != ReduceOp::kSum && DispatchOp<uint8_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::S8: return DispatchOp<int8_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::S16: return DispatchOp<int16_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::S32: return DispatchOp<int32_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::S64: return DispatchOp<int64_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::U8: return DispatchOp<uint8_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::U16: return DispatchOp<uint16_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::U32: return DispatchOp<uint32_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::U64: return DispatchOp<uint64_t>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::F16: return DispatchOp<F16>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::BF16: return DispatchOp<BF16>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::F32: return DispatchOp<float>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::F64: return DispatchOp<double>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::C64: return DispatchOp<std::complex<float>>(op, in, out, begin, end, run, streaming);
    case ffi::DataType::C128: return DispatchOp<std::complex<double>>(op, in, out, begin, end, run, streaming);
    default: return false;
  }
}

}  // namespace

bool ReduceSupported(ffi::DataType dtype, ReduceOp op) {
  static const std::vector<const void*> kNoIn;
  static const std::vector<void*> kNoOut;
  return Dispatch(dtype, op, kNoIn, kNoOut, 0, 0, /*run=*/false, /*streaming=*/false);
}

std::string Reduce(ffi::DataType dtype, ReduceOp op, const std::vector<const void*>& inputs,
                   const std::vector<void*>& outputs, size_t begin, size_t end, bool streaming) {
  if (begin >= end || inputs.empty()) return "";
  if (!Dispatch(dtype, op, inputs, outputs, begin, end, /*run=*/true, streaming)) {
    return std::string("reduction '") + ReduceOpName(op) + "' is not supported for this dtype";
  }
  return "";
}

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& dims, int64_t item_bytes) {
  std::vector<int64_t> strides(dims.size());
  int64_t s = item_bytes;
  for (size_t i = dims.size(); i-- > 0;) {
    strides[i] = s;
    s *= dims[i];
  }
  return strides;
}

void BlockCopy::Compile() {
  std::vector<int64_t> shape2, src2, dst2;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 1) continue;
    if (!shape2.empty() && src2.back() == shape[i] * src_strides[i] &&
        dst2.back() == shape[i] * dst_strides[i]) {
      shape2.back() *= shape[i];
      src2.back() = src_strides[i];
      dst2.back() = dst_strides[i];
    } else {
      shape2.push_back(shape[i]);
      src2.push_back(src_strides[i]);
      dst2.push_back(dst_strides[i]);
    }
  }
  shape = std::move(shape2);
  src_strides = std::move(src2);
  dst_strides = std::move(dst2);
}

void BlockCopy::Run(const char* src, char* dst, bool streaming) const {
  const size_t nd = shape.size();
  if (nd == 0) {
    std::memcpy(dst, src, item_bytes);
    return;
  }
  for (int64_t d : shape) {
    if (d == 0) return;
  }
  // The innermost dimension is contiguous on both sides after Compile (row-major operands).
  const bool inner_contiguous = src_strides[nd - 1] == item_bytes && dst_strides[nd - 1] == item_bytes;
  const size_t loop_dims = inner_contiguous ? nd - 1 : nd;
  const size_t chunk = inner_contiguous ? static_cast<size_t>(shape[nd - 1] * item_bytes) : item_bytes;
  // Each streamed piece ends with a fence: not worth it for small ones.
  constexpr size_t kMinStreamedPiece = 4096;
  streaming = streaming && chunk >= kMinStreamedPiece;
  std::vector<int64_t> idx(loop_dims, 0);
  while (true) {
    int64_t so = 0, dof = 0;
    for (size_t i = 0; i < loop_dims; ++i) {
      so += idx[i] * src_strides[i];
      dof += idx[i] * dst_strides[i];
    }
    StoreResult(dst + dof, src + so, chunk, streaming);
    size_t k = loop_dims;
    while (k > 0) {
      --k;
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
      if (k == 0) return;
    }
    if (loop_dims == 0) return;
  }
}

}  // namespace jaxcomm::cpu
