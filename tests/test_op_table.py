"""The op table (ffi/core/op_table.h) is the one definition of ops and codes: Python's view
of it equals the C++ header, every backend registers exactly its ops, and an unknown code
is an error in Python and in each backend's parsing."""

from __future__ import annotations

import importlib
import os
import re

import numpy as np
import pytest

import jaxcomm
from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_runtime, primitive
from jaxcomm._src.moe import fp8, fused
from jaxcomm._src.tp import put as tp_put
from jaxcomm._src.ops import ragged, reduce, table
from conftest import per_device

# The modules under jaxcomm/_src/ops/ that define primitives.
OP_MODULES = ("reduce", "gather", "alltoall", "permute", "broadcast", "ragged", "ft")
HEADER = os.path.join(os.path.dirname(__file__), "..", "ffi", "core", "op_table.h")


def _header_lists() -> tuple[dict[str, tuple], dict[str, dict[str, str]], dict[str, dict[str, int]]]:
    """The header's lists, read from its text (not through the extension): ops as
    (operands, results, backends, variadic, local)."""
    text = open(HEADER).read()
    variadic = set(re.findall(r"X\((\w+)\)", re.search(r"#define JAXCOMM_VARIADIC_OPS\(X\)(.*)", text).group(1)))
    ops = {m[0]: (int(m[1]), int(m[2]), m[3], m[0] in variadic, False) for m in re.findall(
        r"^\s*X\((\w+), \w+, (\d+), (\d+), (CPU|CPU_CUDA)\)", text, re.M)}
    local = re.search(r"#define JAXCOMM_LOCAL_OPS\(X\)(.*)", text).group(1)
    ops.update({m[0]: (int(m[1]), int(m[2]), m[3], False, True) for m in re.findall(
        r"X\((\w+), \w+, (\d+), (\d+), (CUDA)\)", local)})
    attrs = {}
    for name, body in re.findall(r"#define JAXCOMM_ATTRS_(\w+)\(A\)((?:.*\\\n)*.*)", text):
        attrs[name] = {a: {"I64": "int64", "I64S": "int64[]"}[t]
                       for t, a in re.findall(r"A\((I64S?), (\w+)\)", body)}
    codes = {}
    for macro, kind in (("JAXCOMM_REDUCE_OPS", "reduce_op"), ("JAXCOMM_RAGGED_MODES", "ragged_mode"),
                        ("JAXCOMM_MOE_MODES", "moe_mode"), ("JAXCOMM_MOE_FP8", "moe_fp8")):
        body = re.search(rf"#define {macro}\(X\)((?:.*\\\n)*.*)", text).group(1)
        codes[kind] = {n: int(c) for n, c in re.findall(r"X\((\w+), (\d+), \w+\)", body)}
    return ops, attrs, codes


def test_python_view_equals_the_header():
    ops, attrs, codes = _header_lists()
    assert len(ops) == 15 and set(attrs) == set(ops)
    assert {n for n, e in ops.items() if e[3]} == {"moe_recv", "put_done"}
    assert {n for n, e in ops.items() if e[4]} == {"moe_fp8_quantize"}
    for name, (operands, results, backends, variadic, local) in ops.items():
        entry = table.OPS[name]
        assert entry.target == f"jaxcomm_{name}"
        assert (entry.operands, entry.results) == (operands, results)
        assert entry.backends == {"CPU": ("cpu",), "CUDA": ("cuda",), "CPU_CUDA": ("cpu", "cuda")}[backends]
        assert (entry.variadic, entry.local) == (variadic, local)
        assert dict(entry.attrs) == attrs[name] and list(entry.attrs) == list(attrs[name])
    assert set(table.OPS) == set(ops)
    assert dict(table.REDUCE_OPS) == codes["reduce_op"] == {"sum": 0, "prod": 1, "min": 2, "max": 3}
    assert dict(table.RAGGED_MODES) == codes["ragged_mode"]
    assert dict(table.MOE_MODES) == codes["moe_mode"]
    assert dict(table.MOE_FP8) == codes["moe_fp8"] == {"none": 0, "dequantize": 1, "raw": 2}


def test_op_modules_take_their_codes_from_the_table():
    assert reduce.REDUCE_OPS is table.REDUCE_OPS
    assert (ragged.FORWARD, ragged.TRANSPOSE_OPERAND, ragged.ZERO_RECEIVED) == \
        tuple(table.RAGGED_MODES[m] for m in ("forward", "transpose_operand", "zero_received"))
    assert (fused.GATHER_COPY, fused.GATHER_SCALED, fused.REDUCE, fused.DOT, fused.GATHER_SPARSE,
            fused.GATHER_DEQUANT, fused.GATHER_DEQUANT_SPARSE) == \
        tuple(table.MOE_MODES[m] for m in ("gather_copy", "gather_scaled", "reduce", "dot", "gather_sparse",
                                           "gather_dequant", "gather_dequant_sparse"))
    assert (fused.FP8_NONE, fused.FP8_DEQUANTIZED, fused.FP8_RAW) == \
        tuple(table.MOE_FP8[m] for m in ("none", "dequantize", "raw"))


def test_every_op_has_one_primitive_from_primitive_py():
    # Every op of the table has a primitive, made by primitive.define or define_local...
    found = {}
    for module in (*(importlib.import_module(f"jaxcomm._src.ops.{m}") for m in OP_MODULES),
                   fused, fp8, tp_put):
        found.update({p.name: module.__name__ for p in vars(module).values()
                      if isinstance(p, primitive.Primitive)})
    assert {f"jaxcomm_{name}" for name in table.OPS} <= set(found), set(table.OPS)
    # ... and no module but primitive.py builds a primitive or registers its rules.
    by_hand = re.compile(r"core\.Primitive\(|def_(?:effectful_)?abstract_eval|def_impl|"
                         r"primitive_batchers|register_lowering\(|_outside_shard_map")
    package = os.path.join(os.path.dirname(__file__), "..", "jaxcomm")
    for dirpath, _, files in os.walk(package):
        for f in files:
            path = os.path.join(dirpath, f)
            if f.endswith(".py") and not path.endswith(os.path.join("_src", "primitive.py")):
                assert not by_hand.findall(open(path).read()), path


def test_each_backend_registers_exactly_its_ops():
    def served(backend: str, local: bool) -> set[str]:
        return {n for n, e in table.OPS.items() if backend in e.backends and e.local == local}
    assert set(_jaxcomm.cpu_targets()) == served("cpu", False)
    assert served("cpu", True) == set()
    if cuda_runtime.built_with_cuda():
        assert set(_jaxcomm.cuda_targets()) == served("cuda", False)
        assert set(_jaxcomm.cuda_local_targets()) == served("cuda", True)


def test_unknown_names_and_codes_raise_in_python():
    with pytest.raises(ValueError, match="unknown reduction 'avg'; the op table has sum 0, prod 1"):
        table.reduce_code("avg")
    with pytest.raises(ValueError, match="unknown MoE transport mode 'scatter'"):
        table.moe_mode("scatter")
    with pytest.raises(ValueError, match="op 'all_sum' is not in the op table"):
        table.op("all_sum")
    with pytest.raises(ValueError, match=r"attributes \('reduce_opp',\); the op table says \('reduce_op',\)"):
        table.check_attrs("all_reduce", 1, {"reduce_opp": 0})
    with pytest.raises(ValueError, match="lowered with 2 operands; the op table says 1"):
        table.check_attrs("all_reduce", 2, {"reduce_op": 0})
    with pytest.raises(ValueError, match="unknown MoE dispatch fp8 mode 'e5m2'"):
        table.moe_fp8("e5m2")
    # moe_recv takes the send's two results, then any number of operands it keeps alive.
    assert table.check_attrs("moe_recv", 7, {}).variadic
    with pytest.raises(ValueError, match="lowered with 1 operands; the op table says at least 2"):
        table.check_attrs("moe_recv", 1, {})


@pytest.mark.parametrize("kind,code,message", [
    ("reduce_op", 7, "unknown reduction code 7 (valid: sum 0, prod 1, min 2, max 3)"),
    ("reduce_op", -1, "unknown reduction code -1 (valid: sum 0, prod 1, min 2, max 3)"),
    ("ragged_mode", 3, "unknown ragged_all_to_all mode 3 (valid: forward 0, transpose_operand 1, "
                       "zero_received 2)"),
    ("moe_mode", 7, "unknown MoE transport mode 7 (valid: gather_copy 0, gather_scaled 1, reduce 2, dot 3, "
                    "gather_sparse 4, gather_dequant 5, gather_dequant_sparse 6)"),
    ("moe_fp8", 3, "unknown MoE dispatch fp8 mode 3 (valid: none 0, dequantize 1, raw 2)"),
])
def test_shared_code_check_names_the_code(kind, code, message):
    # The check both backends' parsing calls (the CUDA instantiate stage included).
    assert _jaxcomm.op_code_error(kind, code) == message
    assert _jaxcomm.op_code_error(kind, 0) == ""


def _with_attr(monkeypatch, op: str, name: str, value: int) -> None:
    """Makes the lowering of ``op`` pass ``name=value`` to its handler."""
    real = primitive.lower_collective

    def lower(ctx, lowered_op, operands, params, attrs, **kw):
        if lowered_op == op:
            attrs = {**attrs, name: value}
        return real(ctx, lowered_op, operands, params, attrs, **kw)
    monkeypatch.setattr(primitive, "lower_collective", lower)


def test_host_backend_rejects_an_unknown_reduction_code(mesh8, monkeypatch):
    _with_attr(monkeypatch, "all_reduce", "reduce_op", 7)
    x = np.ones((8, 5, 3), np.float32)  # a shape of its own: jax caches a lowering per type
    with pytest.raises(Exception, match=re.escape("unknown reduction code 7 (valid: sum 0, prod 1, min 2, max 3)")):
        per_device(lambda v: jaxcomm.all_reduce(v, "x", op="max"), mesh8, x)


def test_host_backend_rejects_an_unknown_ragged_mode(mesh8, monkeypatch):
    _with_attr(monkeypatch, "ragged_all_to_all", "mode", 5)
    idx = np.zeros((8, 8), np.int32)

    def f(v, off):
        return jaxcomm.ragged_all_to_all(v, v, off, off, off, off, axis_name="x")
    with pytest.raises(Exception, match=re.escape("unknown ragged_all_to_all mode 5 (valid: forward 0")):
        per_device(f, mesh8, np.ones((8, 7, 2), np.float32), idx)


def test_host_backend_rejects_an_unknown_moe_fp8_mode(mesh8, monkeypatch):
    _with_attr(monkeypatch, "moe_dispatch", "fp8", 3)
    ids = np.tile(np.arange(2, dtype=np.int32), (8, 3, 1))  # 3 tokens per rank, top-2 of 8 experts

    def f(v, i):
        return jaxcomm.moe.dispatch(v, i, num_experts=8, axis_name="x")[0]
    with pytest.raises(Exception, match=re.escape("unknown MoE dispatch fp8 mode 3 (valid: none 0, dequantize 1, raw 2)")):
        per_device(f, mesh8, np.ones((8, 3, 5), np.float32), ids)
