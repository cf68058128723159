"""The op table (ffi/core/op_table.h) is the one definition of ops and codes: Python's view
of it equals the C++ header, every backend registers exactly its ops, and an unknown code
is an error in Python and in each backend's parsing."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import jaxcomm
from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_runtime, primitive
from jaxcomm._src.moe import fused
from jaxcomm._src.ops import ragged, reduce, table
from conftest import per_device

HEADER = os.path.join(os.path.dirname(__file__), "..", "ffi", "core", "op_table.h")


def _header_lists() -> tuple[dict[str, tuple], dict[str, dict[str, str]], dict[str, dict[str, int]]]:
    """The header's lists, read from its text (not through the extension)."""
    text = open(HEADER).read()
    ops = {m[0]: (int(m[1]), int(m[2]), m[3]) for m in re.findall(
        r"^\s*X\((\w+), \w+, (\d+), (\d+), (CPU|CPU_CUDA)\)", text, re.M)}
    attrs = {}
    for name, body in re.findall(r"#define JAXCOMM_ATTRS_(\w+)\(A\)(.*)", text):
        attrs[name] = {a: {"I64": "int64", "I64S": "int64[]"}[t]
                       for t, a in re.findall(r"A\((I64S?), (\w+)\)", body)}
    codes = {}
    for macro, kind in (("JAXCOMM_REDUCE_OPS", "reduce_op"), ("JAXCOMM_RAGGED_MODES", "ragged_mode"),
                        ("JAXCOMM_MOE_MODES", "moe_mode")):
        body = re.search(rf"#define {macro}\(X\)((?:.*\\\n)*.*)", text).group(1)
        codes[kind] = {n: int(c) for n, c in re.findall(r"X\((\w+), (\d+), \w+\)", body)}
    return ops, attrs, codes


def test_python_view_equals_the_header():
    ops, attrs, codes = _header_lists()
    assert len(ops) == 9 and set(attrs) == set(ops)
    for name, (operands, results, backends) in ops.items():
        entry = table.OPS[name]
        assert entry.target == f"jaxcomm_{name}"
        assert (entry.operands, entry.results) == (operands, results)
        assert entry.backends == (("cpu",) if backends == "CPU" else ("cpu", "cuda"))
        assert dict(entry.attrs) == attrs[name] and list(entry.attrs) == list(attrs[name])
    assert set(table.OPS) == set(ops)
    assert dict(table.REDUCE_OPS) == codes["reduce_op"] == {"sum": 0, "prod": 1, "min": 2, "max": 3}
    assert dict(table.RAGGED_MODES) == codes["ragged_mode"]
    assert dict(table.MOE_MODES) == codes["moe_mode"]


def test_op_modules_take_their_codes_from_the_table():
    assert reduce.REDUCE_OPS is table.REDUCE_OPS
    assert (ragged.FORWARD, ragged.TRANSPOSE_OPERAND, ragged.ZERO_RECEIVED) == \
        tuple(table.RAGGED_MODES[m] for m in ("forward", "transpose_operand", "zero_received"))
    assert (fused.GATHER_COPY, fused.GATHER_SCALED, fused.REDUCE, fused.DOT) == \
        tuple(table.MOE_MODES[m] for m in ("gather_copy", "gather_scaled", "reduce", "dot"))


def test_each_backend_registers_exactly_its_ops():
    assert set(_jaxcomm.cpu_targets()) == {n for n, e in table.OPS.items() if "cpu" in e.backends}
    if cuda_runtime.built_with_cuda():
        assert set(_jaxcomm.cuda_targets()) == {n for n, e in table.OPS.items() if "cuda" in e.backends}


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


@pytest.mark.parametrize("kind,code,message", [
    ("reduce_op", 7, "unknown reduction code 7 (valid: sum 0, prod 1, min 2, max 3)"),
    ("reduce_op", -1, "unknown reduction code -1 (valid: sum 0, prod 1, min 2, max 3)"),
    ("ragged_mode", 3, "unknown ragged_all_to_all mode 3 (valid: forward 0, transpose_operand 1, "
                       "zero_received 2)"),
    ("moe_mode", 4, "unknown MoE transport mode 4 (valid: gather_copy 0, gather_scaled 1, reduce 2, dot 3)"),
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
