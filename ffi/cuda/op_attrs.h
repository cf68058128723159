// The CUDA ops' own attributes (core/op_table.h's JAXCOMM_ATTRS_<op> lists), one table:
// each attribute's field, the check it gets at instantiation, and how the attribute
// probe prints it. A new attribute: one JAXCOMM_CUDA_ATTRS entry, its OpAttrs field and
// its set_attr function; a new op reuses them through its op-table line alone.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/kernel_logic.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

// Every attribute a CUDA op binds after the common ones, X(name).
#define JAXCOMM_CUDA_ATTRS(X) \
  X(reduce_op) X(axis_index) X(scatter_dimension) X(split_axis) X(concat_axis) X(sources) X(root) \
  X(mode) X(src_rows) X(dst_rows)

enum class AttrId {
#define JAXCOMM_CUDA_ATTR_ID_(name) name,
  JAXCOMM_CUDA_ATTRS(JAXCOMM_CUDA_ATTR_ID_)
#undef JAXCOMM_CUDA_ATTR_ID_
};

// The op's own attributes, typed and checked at instantiation.
struct OpAttrs {
  logic::ReduceOp reduce_op = logic::ReduceOp::kSum;
  int64_t axis_index = 0, scatter_dimension = 0, split_axis = 0, concat_axis = 0, root = 0;
  int64_t mode = 0;  // MoeMode (moe_transport*) or logic::RaggedMode (ragged_all_to_all)
  int64_t src_rows = 0, dst_rows = 0;
  std::vector<int64_t> sources;  // ppermute: the source rank of each rank, or -1
  std::vector<AttrId> bound;     // the op's attributes, in binding order
};

// What an attribute's check knows of its call.
struct AttrCheck {
  std::string_view op;
  int64_t group_size;
};

// set_attr::<name>(check, value, &attrs): checks the value and stores it; "" or why the
// value is refused (the instantiate stage prefixes the op and call site).
namespace set_attr {
std::string reduce_op(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string axis_index(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string scatter_dimension(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string split_axis(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string concat_axis(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string sources(const AttrCheck& k, xla::ffi::Span<const int64_t> v, OpAttrs* o);
std::string root(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string mode(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string src_rows(const AttrCheck& k, int64_t v, OpAttrs* o);
std::string dst_rows(const AttrCheck& k, int64_t v, OpAttrs* o);
}  // namespace set_attr

// " reduce_op=max scatter_dimension=1": the bound attributes, in binding order.
std::string DescribeAttrs(const OpAttrs& o);

}  // namespace jaxcomm::cuda
