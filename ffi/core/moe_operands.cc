#include "core/moe_operands.h"

#include "core/number_formats.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

bool IsMoeFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

std::string CheckMoeOperands(int64_t mode, const ffi::AnyBuffer& src, const ffi::AnyBuffer& dest,
                             const ffi::AnyBuffer& pos, const ffi::AnyBuffer& w,
                             const ffi::AnyBuffer& g, const ffi::AnyBuffer& result,
                             MoeOperandShape* shape) {
  if (std::string why = CheckMoeMode(mode); !why.empty()) return why;
  auto sd = src.dimensions(), td = dest.dimensions(), od = result.dimensions(), gd = g.dimensions();
  if (sd.size() != 2 || td.size() != 2 || od.size() != 2 || pos.dimensions().size() != 2 ||
      gd.size() != 2 || dest.element_type() != ffi::DataType::S32 ||
      pos.element_type() != ffi::DataType::S32 || w.element_type() != ffi::DataType::F32 ||
      w.element_count() != dest.element_count() || pos.element_count() != dest.element_count()) {
    return "bad operand shapes or dtypes";
  }
  MoeOperandShape& s = *shape;
  s.T = td[0];
  s.K = td[1];
  s.H = sd[1];
  s.gather = IsMoeGather(mode);
  s.rows = s.gather ? od[0] : sd[0];
  s.row_bytes = od[0] ? static_cast<int64_t>(result.size_bytes()) / od[0] : 0;
  s.src_type = src.element_type();
  s.g_type = g.element_type();
  s.out_type = result.element_type();
  const bool floats = IsMoeFloat(s.src_type) && IsMoeFloat(s.out_type);
  bool ok = false;
  switch (mode) {
    case kGatherCopy:
    case kGatherSparse:
      ok = sd[0] == s.T && od[1] == s.H && s.src_type == s.out_type;
      break;
    case kGatherScaled:
      ok = floats && sd[0] == s.T && od[1] == s.H;
      break;
    case kReduce:
      ok = floats && od[0] == s.T && od[1] == s.H;
      break;
    case kDot:
      ok = IsMoeFloat(s.src_type) && IsMoeFloat(s.g_type) && s.out_type == ffi::DataType::F32 &&
           od[0] == s.T && od[1] == s.K && gd[0] == s.T && gd[1] == s.H;
      break;
    case kGatherDequant:
    case kGatherDequantSparse:
      ok = s.src_type == ffi::DataType::F8E4M3FN && s.g_type == ffi::DataType::F32 &&
           IsMoeFloat(s.out_type) && sd[0] == s.T && od[1] == s.H && gd[0] == s.T &&
           gd[1] == Fp8Blocks(s.H);
      break;
    default:
      break;
  }
  return ok ? "" : "operands disagree with the mode";
}

}  // namespace jaxcomm
