"""Random programs against jax.lax: jaxcomm.lax must give the same bits and types.

A seeded generator draws collective calls (op, dtype, shape, axes, tiled/axis/dimension
parameters, axis_index_groups, permutations, pytrees of two dtypes, NaN/inf values); each
batch of calls is one jit(shard_map) program on a 2x4 ("a", "b") mesh run through jax.lax and
jaxcomm.lax side by side (lax_util.both), so a few hundred calls cost a handful of compiles.
A failure names the seed and the call, e.g. ``seed 3 call 7: all_to_all(int8[2,4,1] over
('b', 'a'), split_axis=1, concat_axis=0, tiled=True)``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import rand
from lax_util import assert_identical, both

MESH_AXES = {"a": 2, "b": 4}
AXES = ["a", "b", ("a", "b"), ("b", "a")]
DTYPES = ["float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool", "complex64"]
OPS = ["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "pswapaxes",
       "ppermute", "pshuffle"]
CALLS_PER_PROGRAM = 20
PROGRAMS = 12  # x 20 = 240 calls


class Call(NamedTuple):
    op: str
    axes: Any
    kwargs: dict
    args: tuple  # positional parameters after (x, axis_name)
    inputs: list  # per-device arrays, leading dimension 8
    tree: bool  # the operand is {"p": inputs[0], "q": (inputs[1],)}

    def describe(self) -> str:
        arrays = ", ".join(f"{a.dtype}{list(a.shape[1:])}" for a in self.inputs)
        params = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.op}({'tree of ' if self.tree else ''}{arrays} over {self.axes!r}, {', '.join(params)})"

    def run(self, lax: Any, xs: list) -> Any:
        x = {"p": xs[0], "q": (xs[1],)} if self.tree else xs[0]
        return getattr(lax, self.op)(x, self.axes, *self.args, **self.kwargs)


def _groups(rng: np.random.Generator, size: int) -> list[list[int]] | None:
    sizes = [g for g in (2, 4) if size % g == 0 and g < size]
    if not sizes or rng.random() < 0.6:
        return None
    g = int(rng.choice(sizes))
    return rng.permutation(size).reshape(size // g, g).tolist()


def _data(rng: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
    x = rand((8, *shape), dtype, int(rng.integers(1 << 30)))
    if dtype in ("float32", "bfloat16", "float16") and x.size and rng.random() < 0.3:
        flat = x.reshape(-1)
        for value in rng.choice([np.nan, np.inf, -np.inf, -0.0], size=3):
            flat[rng.integers(flat.size)] = value
    return x


def draw(rng: np.random.Generator, check_vma: bool) -> Call:
    op = str(rng.choice(OPS))
    axes = AXES[rng.integers(len(AXES))]
    size = math.prod(MESH_AXES[a] for a in ((axes,) if isinstance(axes, str) else axes))
    allowed = [d for d in DTYPES
               if not (op in ("pmax", "pmin") and d in ("complex64", "bool"))  # XLA:CPU has no such max
               and not (op == "psum_scatter" and d == "bool")]  # jax.lax cannot add bools
    dtypes = [str(d) for d in rng.choice(allowed, size=2)]
    groups = None
    if op in ("pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "pswapaxes") or \
            (op in ("psum", "pmean") and not check_vma):  # jax.lax refuses those under check_vma
        groups = _groups(rng, size)
    r = len(groups[0]) if groups else size
    rank = int(rng.integers(0 if op in ("psum", "pmean", "pmax", "pmin", "all_gather", "ppermute",
                                        "pshuffle") else 1, 4))
    shape = [int(d) for d in rng.integers(1, 4, size=rank)]
    kwargs: dict = {"axis_index_groups": groups} if groups else {}
    args: tuple = ()
    if op == "all_gather":
        tiled = bool(rank and rng.random() < 0.5)
        kwargs.update(tiled=tiled, axis=int(rng.integers(0, rank + (0 if tiled else 1))))
    elif op == "psum_scatter":
        tiled = bool(rng.random() < 0.5)
        dim = int(rng.integers(rank))
        shape[dim] = r * (int(rng.integers(1, 3)) if tiled else 1)
        kwargs.update(scatter_dimension=dim, tiled=tiled)
    elif op == "all_to_all":
        tiled = bool(rng.random() < 0.5)
        split, concat = (int(a) for a in rng.integers(rank, size=2))
        shape[split] = r * (int(rng.integers(1, 3)) if tiled else 1)
        args = (split, concat)
        kwargs.update(tiled=tiled)
    elif op == "pswapaxes":
        axis = int(rng.integers(rank))
        shape[axis] = r
        args = (axis,)
    elif op == "ppermute":
        n = int(rng.integers(1, size + 1))
        src, dst = rng.permutation(size)[:n], rng.permutation(size)[:n]
        # jax.lax also takes negative indices, counted from the end
        args = ([(int(s) - size * int(rng.random() < 0.2), int(d)) for s, d in zip(src, dst)],)
    elif op == "pshuffle":
        args = ([int(i) for i in rng.permutation(size)],)
    tree = bool(rng.random() < 0.3)
    inputs = [_data(rng, tuple(shape), d) for d in (dtypes if tree else dtypes[:1])]
    return Call(op, axes, kwargs, args, inputs, tree)


@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_random_programs(seed):
    check_vma = seed % 3 != 2
    rng = np.random.default_rng(seed)
    calls = [draw(rng, check_vma) for _ in range(CALLS_PER_PROGRAM)]
    inputs = [a for c in calls for a in c.inputs]
    starts = np.cumsum([0] + [len(c.inputs) for c in calls])

    def program(lax, *xs):
        return [c.run(lax, list(xs[starts[i]:starts[i + 1]])) for i, c in enumerate(calls)]

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    try:
        got, want = both(mesh, program, *inputs, check_vma=check_vma, fast=False)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}\ncalls:\n" + "\n".join(
            f"  {i}: {c.describe()}" for i, c in enumerate(calls))) from None
    for i, (c, g, w) in enumerate(zip(calls, got, want)):
        assert_identical(g, w, f"seed {seed} call {i}: {c.describe()} (check_vma={check_vma})")
