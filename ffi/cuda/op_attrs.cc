#include "cuda/op_attrs.h"

#include <sstream>

#include "core/op_table.h"

namespace jaxcomm::cuda {
namespace {

std::string NonNegative(const char* name, int64_t v, int64_t* field) {
  if (v < 0) return std::string(name) + " must be non-negative, got " + std::to_string(v);
  *field = v;
  return "";
}

void Print(std::ostream& s, int64_t v) { s << v; }
void Print(std::ostream& s, logic::ReduceOp v) { s << ReduceOpName(v); }
void Print(std::ostream& s, const std::vector<int64_t>& v) {
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? " " : "") << v[i];
  s << "]";
}

}  // namespace

namespace set_attr {

std::string reduce_op(const AttrCheck&, int64_t v, OpAttrs* o) {
  std::string why = CheckReduceOp(v);
  if (why.empty()) o->reduce_op = static_cast<logic::ReduceOp>(v);
  return why;
}
std::string axis_index(const AttrCheck&, int64_t v, OpAttrs* o) { return NonNegative("axis_index", v, &o->axis_index); }
std::string scatter_dimension(const AttrCheck&, int64_t v, OpAttrs* o) {
  return NonNegative("scatter_dimension", v, &o->scatter_dimension);
}
std::string split_axis(const AttrCheck&, int64_t v, OpAttrs* o) { return NonNegative("split_axis", v, &o->split_axis); }
std::string concat_axis(const AttrCheck&, int64_t v, OpAttrs* o) { return NonNegative("concat_axis", v, &o->concat_axis); }
std::string src_rows(const AttrCheck&, int64_t v, OpAttrs* o) { return NonNegative("src_rows", v, &o->src_rows); }
std::string dst_rows(const AttrCheck&, int64_t v, OpAttrs* o) { return NonNegative("dst_rows", v, &o->dst_rows); }

std::string sources(const AttrCheck& k, xla::ffi::Span<const int64_t> v, OpAttrs* o) {
  if (static_cast<int64_t>(v.size()) != k.group_size) {
    return "sources has " + std::to_string(v.size()) + " entries for a group of " + std::to_string(k.group_size);
  }
  for (int64_t s : v) {
    if (s < -1 || s >= k.group_size) return "source rank " + std::to_string(s) + " is outside the group";
  }
  o->sources.assign(v.begin(), v.end());
  return "";
}

std::string root(const AttrCheck& k, int64_t v, OpAttrs* o) {
  if (v < 0 || v >= k.group_size) return "root " + std::to_string(v) + " is outside the group";
  o->root = v;
  return "";
}

// ragged_all_to_all's mode lists ragged modes; the MoE transports' list MoE modes.
std::string mode(const AttrCheck& k, int64_t v, OpAttrs* o) {
  std::string why = k.op == "ragged_all_to_all" ? CheckRaggedMode(v) : CheckMoeMode(v);
  if (why.empty()) o->mode = v;
  return why;
}

}  // namespace set_attr

std::string DescribeAttrs(const OpAttrs& o) {
  std::ostringstream s;
  for (AttrId id : o.bound) {
    switch (id) {
#define JAXCOMM_CUDA_PRINT_ATTR_(name) \
  case AttrId::name:                   \
    s << " " #name "=";                \
    Print(s, o.name);                  \
    break;
      JAXCOMM_CUDA_ATTRS(JAXCOMM_CUDA_PRINT_ATTR_)
#undef JAXCOMM_CUDA_PRINT_ATTR_
    }
  }
  return s.str();
}

}  // namespace jaxcomm::cuda
