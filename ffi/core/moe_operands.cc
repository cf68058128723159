#include "core/moe_operands.h"

namespace jaxcomm {

namespace ffi = xla::ffi;

std::string CheckMoeOperands(int64_t mode, const ffi::AnyBuffer& src, const ffi::AnyBuffer& dest,
                             const ffi::AnyBuffer& pos, const ffi::AnyBuffer& w,
                             const ffi::AnyBuffer& g, const ffi::AnyBuffer& result,
                             MoeOperandShape* shape) {
  auto sd = src.dimensions(), td = dest.dimensions(), od = result.dimensions();
  if (sd.size() != 2 || td.size() != 2 || od.size() != 2 || pos.dimensions().size() != 2 ||
      dest.element_type() != ffi::DataType::S32 || pos.element_type() != ffi::DataType::S32 ||
      w.element_type() != ffi::DataType::F32 || w.element_count() != dest.element_count() ||
      pos.element_count() != dest.element_count()) {
    return "bad operand shapes or dtypes";
  }
  MoeOperandShape& s = *shape;
  s.T = td[0];
  s.K = td[1];
  s.H = sd[1];
  s.gather = mode == kGatherCopy || mode == kGatherScaled;
  s.rows = s.gather ? od[0] : sd[0];
  s.row_bytes = s.gather ? (od[0] ? static_cast<int64_t>(result.size_bytes()) / od[0] : 0) : s.H * 4;
  const bool f32 = src.element_type() == ffi::DataType::F32 && result.element_type() == ffi::DataType::F32;
  bool ok = false;
  switch (mode) {
    case kGatherCopy:
      ok = sd[0] == s.T && od[1] == s.H && src.element_type() == result.element_type();
      break;
    case kGatherScaled:
      ok = f32 && sd[0] == s.T && od[1] == s.H;
      break;
    case kReduce:
      ok = f32 && od[0] == s.T && od[1] == s.H;
      break;
    case kDot:
      ok = f32 && od[0] == s.T && od[1] == s.K && g.element_type() == ffi::DataType::F32 &&
           static_cast<int64_t>(g.element_count()) == s.T * s.H;
      break;
    default:
      break;
  }
  return ok ? "" : "operands disagree with the mode";
}

}  // namespace jaxcomm
