"""Each custom call names the program it is lowered into (jaxcomm/_src/program.py), so
calls of one helper collective in two programs never pair across processes.

The cross-process behaviour (opposite dispatch orders fail with MISMATCH, opposite compile
orders still pair) is in tests/test_mismatch.py; here, in one process, what the attribute
says: the same program lowered twice is named alike, a different structure is not, a
literal's value counts, and JAXCOMM_MATCH_PROGRAMS=0 leaves the program out.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src import program

MESH = jax.make_mesh((8,), ("x",))
_ATTR = re.compile(r'call_site = "([^"]*)"')


def _helper(v):
    return jaxcomm.all_reduce(v, "x")


def _sites(f, x=None) -> list[str]:
    """The call_site attributes of f's jaxcomm custom calls, in the lowered text."""
    x = jnp.ones((8, 4), jnp.float32) if x is None else x
    x = jax.device_put(x, NamedSharding(MESH, P("x")))
    prog = jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("x"), out_specs=P("x")))
    return _ATTR.findall(prog.lower(x).as_text())


def _program(site: str) -> str:
    return site.split(" in ", 1)[1]


def test_the_call_site_names_the_program():
    (site,) = _sites(_helper)
    assert re.fullmatch(r"test_program\.py:\d+ \(_helper\) in jit__helper#[0-9a-f]{8}", site), site


def test_the_same_program_is_named_alike_when_traced_again():
    def body(v):
        return _helper(jnp.sin(v))
    first, again = _sites(body), _sites(lambda v: body(v))
    # The module's name follows the function; the digest follows the structure alone.
    assert _program(first[0]).split("#")[1] == _program(again[0]).split("#")[1], (first, again)
    assert _sites(body) == first


def test_a_different_structure_is_another_program():
    plain = _program(_sites(lambda v: _helper(v))[0])
    scaled = _program(_sites(lambda v: _helper(v * 10))[0])
    shifted = _program(_sites(lambda v: _helper(v + 10))[0])
    wider = _program(_sites(lambda v: _helper(v), jnp.ones((8, 6), jnp.float32))[0])
    halves = _program(_sites(lambda v: _helper(v), jnp.ones((8, 4), jnp.bfloat16))[0])
    assert len({plain, scaled, shifted, wider, halves}) == 5, (plain, scaled, shifted, wider, halves)


def test_a_literal_value_is_part_of_the_program():
    # v * 10 and v * 3 are two programs: each numbers its instructions on its own, so
    # processes that compiled different sets of them still pair (tests/test_mismatch.py).
    ten = _program(_sites(lambda v: _helper(v * 10))[0])
    three = _program(_sites(lambda v: _helper(v * 3))[0])
    three_again = _program(_sites(lambda v: _helper(v * 3))[0])
    assert ten != three and three.split("#")[1] == three_again.split("#")[1], (ten, three)


def test_two_calls_of_one_helper_in_one_program_share_its_name():
    def body(v):
        return _helper(v) + _helper(2 * v)
    sites = _sites(body)
    assert len(sites) == 2 and sites[0] == sites[1], sites


def test_sub_jaxprs_count():
    def branchy(op):
        def body(v):
            return jax.lax.cond(v[0, 0] > 0, lambda u: op(_helper(u)), _helper, v)
        return body
    assert _program(_sites(branchy(jnp.sin))[0]) != _program(_sites(branchy(jnp.cos))[0])


def test_match_programs_off_leaves_the_call_site_alone(monkeypatch):
    monkeypatch.setenv("JAXCOMM_MATCH_PROGRAMS", "0")
    (site,) = _sites(lambda v: _helper(v - 1))
    assert re.fullmatch(r"test_program\.py:\d+ \(_helper\)", site), site


def test_a_malformed_setting_is_refused(monkeypatch):
    monkeypatch.setenv("JAXCOMM_MATCH_PROGRAMS", "yes")
    with pytest.raises(ValueError, match=r"JAXCOMM_MATCH_PROGRAMS must be 0 or 1, got 'yes'"):
        _sites(lambda v: _helper(v - 2))


def test_results_are_unchanged():
    x = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4), NamedSharding(MESH, P("x")))
    prog = jax.jit(jax.shard_map(_helper, mesh=MESH, in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(prog(x)), np.tile(np.asarray(x).sum(0), (8, 1)))


def test_plain_parameters_are_deterministic_text():
    # Sets of names iterate in an order that depends on string hashing (per process).
    assert program._plain(frozenset({"b", "a", "c"})) == "{'a','b','c'}"
    assert program._plain(("x", 2, None)) == "('x',2,None)"
    assert program._plain(np.dtype("float32")) == "float32"
    assert program._plain(lambda: 0) is None
