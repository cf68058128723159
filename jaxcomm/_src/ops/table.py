"""The op table (ffi/core/op_table.h), as the extension hands it to Python.

One definition of every op (its FFI target, operand and result counts, the backends that
serve it, its own attributes) and of the codes of its enum attributes. The op modules
take their codes from here, and :func:`check_attrs` holds every lowering to it, so that
Python and C++ cannot drift apart.

Example::

    from jaxcomm._src.ops import table
    table.reduce_code("max")          # 3
    table.OPS["ppermute"].attrs       # {'sources': 'int64[]'}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxcomm import _jaxcomm


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """One op of the table.

    Attributes:
      name: the op (``all_reduce``).
      target: its FFI target (``jaxcomm_all_reduce``), the same on every platform.
      operands, results: how many buffers its custom call takes and returns.
      backends: which backends have a handler for it (``"cpu"``, ``"cuda"``).
      attrs: its own attributes (after the common ones), name -> ``"int64"`` or ``"int64[]"``.
      variadic: whether ``operands`` is a minimum (moe_recv: the send's results, then the
        operands it keeps alive).
      local: a kernel on one device's data, outside any group (moe_fp8_quantize): no
        common attributes, no state; lowered with ``jax.ffi.ffi_lowering`` alone.
    """

    name: str
    target: str
    operands: int
    results: int
    backends: tuple[str, ...]
    attrs: Mapping[str, str]
    variadic: bool = False
    local: bool = False


def _load() -> tuple[dict[str, OpEntry], dict[str, dict[str, int]]]:
    raw: dict[str, Any] = _jaxcomm.op_table()
    ops = {name: OpEntry(name=name, target=str(e["target"]), operands=int(e["operands"]),
                         results=int(e["results"]), backends=tuple(e["backends"]),
                         attrs=dict(e["attrs"]), variadic=bool(e["variadic"]),
                         local=bool(e["local"]))
           for name, e in raw["ops"].items()}
    codes = {kind: {str(k): int(v) for k, v in raw[kind].items()}
             for kind in ("reduce_op", "ragged_mode", "moe_mode", "moe_fp8")}
    return ops, codes


OPS, _CODES = _load()

#: all_reduce / reduce_scatter's ``reduce_op`` codes: {"sum": 0, "prod": 1, "min": 2, "max": 3}.
REDUCE_OPS: Mapping[str, int] = _CODES["reduce_op"]
#: ragged_all_to_all's ``mode`` codes (forward, and the two halves of its transpose).
RAGGED_MODES: Mapping[str, int] = _CODES["ragged_mode"]
#: moe_transport's ``mode`` codes (core/moe_modes.h says what each does).
MOE_MODES: Mapping[str, int] = _CODES["moe_mode"]
#: moe_dispatch's ``fp8`` codes: tokens in their dtype, FP8 delivered dequantized, FP8 raw.
MOE_FP8: Mapping[str, int] = _CODES["moe_fp8"]


def _code(kind: str, codes: Mapping[str, int], name: str) -> int:
    try:
        return codes[name]
    except KeyError:
        raise ValueError(f"jaxcomm: unknown {kind} {name!r}; the op table has "
                         f"{', '.join(f'{k} {v}' for k, v in codes.items())}") from None


def reduce_code(name: str) -> int:
    """The ``reduce_op`` code of reduction ``name`` (a ValueError for an unknown one)."""
    return _code("reduction", REDUCE_OPS, name)


def ragged_mode(name: str) -> int:
    """The ``mode`` code of ragged_all_to_all mode ``name``."""
    return _code("ragged_all_to_all mode", RAGGED_MODES, name)


def moe_mode(name: str) -> int:
    """The ``mode`` code of MoE transport mode ``name``."""
    return _code("MoE transport mode", MOE_MODES, name)


def moe_fp8(name: str) -> int:
    """The ``fp8`` code of moe_dispatch's FP8 mode ``name`` (none, dequantize, raw)."""
    return _code("MoE dispatch fp8 mode", MOE_FP8, name)


def op(name: str) -> OpEntry:
    """The table's entry of op ``name`` (a ValueError naming the known ones otherwise)."""
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"jaxcomm: op {name!r} is not in the op table (ffi/core/op_table.h); "
                         f"it has {', '.join(OPS)}") from None


def check_attrs(name: str, operands: int, attrs: Mapping[str, Any]) -> OpEntry:
    """Checks a lowering of op ``name`` against the table: its operand count and its own
    attribute names (in the table's order). Returns the op's entry."""
    entry = op(name)
    if operands != entry.operands and not (entry.variadic and operands > entry.operands):
        at_least = "at least " if entry.variadic else ""
        raise ValueError(f"jaxcomm.{name}: lowered with {operands} operands; the op table "
                         f"says {at_least}{entry.operands}")
    if tuple(attrs) != tuple(entry.attrs):
        raise ValueError(f"jaxcomm.{name}: lowered with attributes {tuple(attrs)}; the op "
                         f"table says {tuple(entry.attrs)}")
    return entry
