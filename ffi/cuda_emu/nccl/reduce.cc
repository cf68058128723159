#include "cuda_emu/nccl/reduce.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/number_formats.h"

namespace jaxcomm::nccl_mock {
namespace {

template <typename T>
T Apply(ncclRedOp_t op, T a, T b) {
  switch (op) {
    case ncclSum:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;  // wraps, as NCCL's integer sums do
        return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
      } else {
        return a + b;
      }
    case ncclProd:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
      } else {
        return a * b;
      }
    // Floating point: fmax/fmin, as NCCL's kernels (a NaN loses to a number).
    case ncclMax:
      if constexpr (std::is_floating_point_v<T>) return std::fmax(a, b); else return b > a ? b : a;
    case ncclMin:
      if constexpr (std::is_floating_point_v<T>) return std::fmin(a, b); else return b < a ? b : a;
    default: return a;
  }
}

// Reduces element type T (accumulated as Acc, converted with Load/Store).
template <typename T, typename Acc, typename Load, typename Store>
void ReduceAs(ncclRedOp_t op, const void* const* in, int ranks, void* out, size_t count, Load load,
              Store store) {
  T* o = static_cast<T*>(out);
  for (size_t i = 0; i < count; ++i) {
    Acc acc = load(static_cast<const T*>(in[0])[i]);
    for (int r = 1; r < ranks; ++r) acc = Apply<Acc>(op, acc, load(static_cast<const T*>(in[r])[i]));
    o[i] = store(acc);
  }
}

template <typename T>
void ReducePlain(ncclRedOp_t op, const void* const* in, int ranks, void* out, size_t count) {
  ReduceAs<T, T>(op, in, ranks, out, count, [](T v) { return v; }, [](T v) { return v; });
}

}  // namespace

size_t TypeBytes(ncclDataType_t type) {
  switch (type) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

const char* TypeName(ncclDataType_t type) {
  static const char* const names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64",
                                      "float16", "float32", "float64", "bfloat16"};
  return type >= 0 && type < ncclNumTypes ? names[type] : "unknown type";
}

const char* OpName(ncclRedOp_t op) {
  static const char* const names[] = {"sum", "prod", "max", "min"};
  return op >= 0 && op < ncclNumOps ? names[op] : "unknown op";
}

void Reduce(ncclDataType_t type, ncclRedOp_t op, const void* const* in, int ranks, void* out, size_t count) {
  switch (type) {
    case ncclInt8: return ReducePlain<int8_t>(op, in, ranks, out, count);
    case ncclUint8: return ReducePlain<uint8_t>(op, in, ranks, out, count);
    case ncclInt32: return ReducePlain<int32_t>(op, in, ranks, out, count);
    case ncclUint32: return ReducePlain<uint32_t>(op, in, ranks, out, count);
    case ncclInt64: return ReducePlain<int64_t>(op, in, ranks, out, count);
    case ncclUint64: return ReducePlain<uint64_t>(op, in, ranks, out, count);
    case ncclFloat32: return ReducePlain<float>(op, in, ranks, out, count);
    case ncclFloat64: return ReducePlain<double>(op, in, ranks, out, count);
    case ncclFloat16:
      return ReduceAs<uint16_t, float>(op, in, ranks, out, count, F16ToF32, F32ToF16);
    case ncclBfloat16:
      return ReduceAs<uint16_t, float>(op, in, ranks, out, count, Bf16ToF32, F32ToBf16);
    default: return;
  }
}

}  // namespace jaxcomm::nccl_mock
