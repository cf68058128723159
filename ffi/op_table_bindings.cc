// Hands core/op_table.h to Python (jaxcomm/_src/ops/table.py), and registers the host
// backend's handlers from it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "core/op_table.h"
#include "cpu/ft.h"
#include "cpu/handlers.h"
#include "cpu/moe_dispatch.h"
#include "cpu/moe_kernels.h"
#include "cpu/moe_split.h"
#include "cpu/put.h"
#include "cpu/ragged.h"

namespace nb = nanobind;

namespace jaxcomm {

void RegisterOpTable(nb::module_& m) {
  m.def("op_table", [] {
    nb::dict ops;
#define JAXCOMM_ATTR_ENTRY_(type, name) attrs[#name] = std::string(#type) == "I64" ? "int64" : "int64[]";
#define JAXCOMM_OP_ENTRY_(name, Handler, operands, results, backends)                    \
  {                                                                                      \
    nb::dict attrs;                                                                      \
    JAXCOMM_ATTRS_##name(JAXCOMM_ATTR_ENTRY_)                                            \
    nb::dict op;                                                                         \
    op["target"] = "jaxcomm_" #name;                                                     \
    op["operands"] = operands;                                                           \
    op["results"] = results;                                                             \
    op["backends"] = std::string(#backends) == "CPU"    ? nb::make_tuple("cpu")          \
                     : std::string(#backends) == "CUDA" ? nb::make_tuple("cuda")         \
                                                        : nb::make_tuple("cpu", "cuda"); \
    op["attrs"] = attrs;                                                                 \
    op["variadic"] = false;                                                              \
    op["local"] = false;                                                                 \
    ops[#name] = op;                                                                     \
  }
    JAXCOMM_OPS(JAXCOMM_OP_ENTRY_)
    JAXCOMM_LOCAL_OPS(JAXCOMM_OP_ENTRY_)
#undef JAXCOMM_OP_ENTRY_
#define JAXCOMM_VARIADIC_ENTRY_(name) ops[#name]["variadic"] = true;
    JAXCOMM_VARIADIC_OPS(JAXCOMM_VARIADIC_ENTRY_)
#undef JAXCOMM_VARIADIC_ENTRY_
#define JAXCOMM_LOCAL_ENTRY_(name, Handler, operands, results, backends) ops[#name]["local"] = true;
    JAXCOMM_LOCAL_OPS(JAXCOMM_LOCAL_ENTRY_)
#undef JAXCOMM_LOCAL_ENTRY_
#undef JAXCOMM_ATTR_ENTRY_
    nb::dict table;
    table["ops"] = ops;
#define JAXCOMM_CODE_ENTRY_(name, code, Enumerator) codes[#name] = code;
#define JAXCOMM_CODE_LIST_(LIST, attribute) \
  {                                         \
    nb::dict codes;                         \
    LIST(JAXCOMM_CODE_ENTRY_)               \
    table[#attribute] = codes;              \
  }
    JAXCOMM_CODE_LISTS(JAXCOMM_CODE_LIST_)
#undef JAXCOMM_CODE_LIST_
#undef JAXCOMM_CODE_ENTRY_
    return table;
  }, "core/op_table.h: {'ops': {name: {target, operands, results, backends, attrs: {name: "
     "type}, variadic, local}}, 'reduce_op': {name: code}, 'ragged_mode': {...}, 'moe_mode': "
     "{...}, 'moe_fp8': {...}}.");

  m.def("op_code_error", [](const std::string& kind, int64_t code) {
    if (kind == "reduce_op") return CheckReduceOp(code);
    if (kind == "ragged_mode") return CheckRaggedMode(code);
    if (kind == "moe_mode") return CheckMoeMode(code);
    if (kind == "moe_fp8") return CheckMoeFp8(code);
    throw nb::value_error(("op_code_error: no code list " + kind).c_str());
  }, nb::arg("kind"), nb::arg("code"),
     "What every backend's parsing says of `code` as a `kind` code ('' when valid); tests.");

  m.def("cpu_targets", [] {
    nb::dict targets;
    auto stages = [](XLA_FFI_Handler* execute) {
      nb::dict d;
      d["instantiate"] = nb::capsule(reinterpret_cast<void*>(cpu::kInstantiate));
      d["execute"] = nb::capsule(reinterpret_cast<void*>(execute));
      return d;
    };
#define JAXCOMM_CPU_TARGET_(name, Handler, operands, results, backends) targets[#name] = stages(cpu::k##Handler);
    JAXCOMM_OPS(JAXCOMM_CPU_TARGET_)
#undef JAXCOMM_CPU_TARGET_
    return targets;
  }, "Maps op name -> {stage: handler capsule} for platform 'cpu' (every op of the table).");
}

}  // namespace jaxcomm
