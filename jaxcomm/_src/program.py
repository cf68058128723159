"""The identity of the program a collective is lowered into, the same in every process.

Calls of one collective pair across processes by their instruction key (ffi/core/
call_attrs.h): a hash of the call's attributes, numbered by how many instructions with the
same attributes this process instantiated before. Without the program in the attributes,
two programs that call one helper collective (same call site, axis and groups) share a
key sequence: dispatched in opposite orders across processes they would pair with each
other and return a sum of two different programs' operands, and compiled in opposite
orders they would never pair. So each call's ``call_site`` attribute names its program:
``"step.py:12 (loss) in jit_train_step#3fa2c1d0"``, the module's name and a digest of its
jaxpr's structure. Processes that run different programs then wait in different
instructions, and the mismatch check (JAXCOMM_MISMATCH_GRACE_S) fails them, naming both.

The digest covers what every process traces alike from the same code: each equation's
primitive, its operands' and results' types, its literal operands' values and its
parameters that are plain values, recursively into sub-jaxprs. It leaves out what is not
plain data (callbacks, meshes, shardings) and the values of captured arrays. Literal values
count because two programs that differ only in a constant (``v * 10`` and ``v * 3``) are
two programs: left out, both would number their instructions in one sequence, and
processes that compiled different sets of them would not pair. The price: a program whose
literal depends on the process (``x + jax.process_index()`` inside ``jit``) differs by
process and fails with MISMATCH, as JAX's rule that every process runs the same programs
says it may; ``JAXCOMM_MATCH_PROGRAMS=0`` leaves the program out altogether.
"""

from __future__ import annotations

import hashlib
import sys
import weakref
from typing import Any

import numpy as np

from jax._src import core
from jax._src.interpreters import mlir

from jaxcomm._src import config

_PLAIN = (bool, int, float, str, bytes, type(None))
# Digests per jaxpr being lowered (one per program, however many calls it has).
_DIGESTS: weakref.WeakKeyDictionary[core.ClosedJaxpr, str] = weakref.WeakKeyDictionary()


def _plain(value: Any) -> str | None:
    """A deterministic text of a parameter that is plain data; None for anything else."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)):
        parts = [_plain(v) for v in value]
        return None if any(p is None for p in parts) else "(" + ",".join(parts) + ")"
    if isinstance(value, (frozenset, set)):  # iteration order follows string hashing: sort
        parts = [_plain(v) for v in value]
        return None if any(p is None for p in parts) else "{" + ",".join(sorted(parts)) + "}"
    if isinstance(value, np.dtype):
        return str(value)
    return None


def _operand(v: Any, texts: dict[Any, str]) -> str:
    if isinstance(v, core.Literal):  # a scalar: its value is part of the program
        return f"{v.aval}={np.asarray(v.val).item()!r}"
    text = texts.get(v.aval)
    if text is None:  # most operands share a few types: print each once
        text = texts[v.aval] = str(v.aval)
    return text


def _jaxprs_in(value: Any) -> list[core.Jaxpr]:
    if isinstance(value, core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, core.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _jaxprs_in(v)]
    return []


def _digest_jaxpr(jaxpr: core.Jaxpr, h: Any, seen: dict[int, str], texts: dict[Any, str]) -> None:
    key = id(jaxpr)
    if key in seen:  # a sub-jaxpr shared by many equations: once, then by reference
        h.update(seen[key].encode())
        return
    sub = hashlib.blake2b(digest_size=8)
    sub.update(" ".join(_operand(v, texts) for v in (*jaxpr.constvars, *jaxpr.invars)).encode())
    for eqn in jaxpr.eqns:
        sub.update(f"|{eqn.primitive.name}(".encode())
        sub.update(" ".join(_operand(v, texts) for v in eqn.invars).encode())
        sub.update(b")->")
        sub.update(" ".join(_operand(v, texts) for v in eqn.outvars).encode())
        for name in sorted(eqn.params):
            value = eqn.params[name]
            inner = _jaxprs_in(value)
            if inner:
                sub.update(f";{name}=".encode())
                for j in inner:
                    _digest_jaxpr(j, sub, seen, texts)
            else:
                text = _plain(value)
                sub.update(f";{name}={'?' if text is None else text}".encode())
    seen[key] = sub.hexdigest()
    h.update(seen[key].encode())


def _lowered_jaxpr() -> core.ClosedJaxpr | None:
    """The jaxpr of the module being lowered (jax's lower_jaxpr_to_module holds it)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "lower_jaxpr_to_module" and frame.f_code.co_filename == mlir.__file__:
            jaxpr = frame.f_locals.get("jaxpr")
            return jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else None
        frame = frame.f_back
    return None


def program_of(module_context: mlir.ModuleContext) -> str:
    """``"jit_step#3fa2c1d0"``: the program being lowered, named alike in every process
    that traces the same code (the digest is computed once per program)."""
    try:
        name = str(module_context.module.operation.attributes["sym_name"]).strip('"')
    except KeyError:
        name = "<module>"
    jaxpr = _lowered_jaxpr()
    if jaxpr is None:  # lowered by a path that keeps no jaxpr in reach: the name alone
        return name
    digest = _DIGESTS.get(jaxpr)
    if digest is None:
        h = hashlib.blake2b(digest_size=4)
        _digest_jaxpr(jaxpr.jaxpr, h, {}, {})
        digest = _DIGESTS[jaxpr] = h.hexdigest()
    return f"{name}#{digest}"


def call_site_attribute(module_context: mlir.ModuleContext, call_site: str) -> str:
    """The ``call_site`` attribute of a custom call: the user's source location, then the
    program it is lowered into (unless JAXCOMM_MATCH_PROGRAMS=0)."""
    if not config.match_programs():
        return call_site
    return f"{call_site} in {program_of(module_context)}"
