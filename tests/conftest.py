"""Shared test setup: 8 emulated CPU devices, meshes, and a shard_map runner.

Helpers (import with ``from conftest import ...``; tests/ is on sys.path under pytest's
default import mode):

  run_sharded(f, mesh, in_specs, out_specs, *args, check_vma=True)
      jit(shard_map(f)) with every arg first device_put to NamedSharding(mesh, spec);
      returns the outputs as numpy arrays (same pytree structure).
  per_device(f, mesh, *args, check_vma=True)
      Each arg has a leading dimension of mesh.size: device k (in the order of the mesh's
      flattened axes, i.e. row-major over mesh.axis_names) gets ``arg[k]``; ``f`` sees
      that local slice. Returns f's outputs stacked per device (leading dim mesh.size).
  rand(shape, dtype, seed=0)
      Deterministic test data of any dtype (small integers for ints, 0/1 for bool,
      values exactly representable in half precision for floats).

Fixtures: ``mesh8`` (8 devices, axis "x"), ``mesh2x4`` (axes ("dp", "ep")), ``x64``
(enables jax_enable_x64 for one test and restores it afterwards).
"""

from __future__ import annotations

import os
import re

# Must happen before jax is imported anywhere in the test session.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = (_flags.strip() + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

NUM_DEVICES = 8


def run_sharded(f, mesh, in_specs, out_specs, *args, check_vma=True):
    """Runs ``jax.jit(jax.shard_map(f, ...))(*args)`` and returns numpy outputs."""
    specs = in_specs if isinstance(in_specs, tuple) else (in_specs,)
    if len(specs) != len(args):
        raise ValueError(f"{len(args)} args but {len(specs)} in_specs")
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_specs,
                              check_vma=check_vma))
    return jax.tree.map(np.asarray, g(*placed))


def per_device(f, mesh, *args, check_vma=True):
    """Gives device k ``args[i][k]`` and returns f's results stacked over devices."""
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    for a in args:
        if np.shape(a)[0] != mesh.size:
            raise ValueError(f"leading dimension must be {mesh.size}, got shape {np.shape(a)}")

    def body(*xs):
        out = f(*(x[0] for x in xs))
        out = jax.tree.map(lambda y: jax.numpy.expand_dims(y, 0), out)
        # A non-empty extra output: with a single zero-size output, jax 0.10.2 hands
        # back shards that claim the global shape and np.asarray fails.
        return out, jax.numpy.zeros((1,), np.int8)

    # out_specs is a pytree prefix: the one spec applies to every output leaf.
    out, _ = run_sharded(body, mesh, (spec,) * len(args), spec, *args, check_vma=check_vma)
    return out


def rand(shape, dtype, seed=0):
    """Deterministic numpy data of ``shape`` and ``dtype`` (bfloat16 via ml_dtypes)."""
    rng = np.random.default_rng(seed)
    dtype = jax.numpy.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.unsignedinteger):
        return rng.integers(0, 16, size=shape).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-8, 8, size=shape).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        re_ = rng.integers(-16, 16, size=shape) / 4
        im = rng.integers(-16, 16, size=shape) / 4
        return (re_ + 1j * im).astype(dtype)
    # Floats (incl. bfloat16): multiples of 1/8 in [-4, 4), exact in every float type.
    return (rng.integers(-32, 32, size=shape) / 8).astype(dtype)


@pytest.fixture(scope="session")
def mesh8():
    return jax.make_mesh((NUM_DEVICES,), ("x",))


@pytest.fixture(scope="session")
def mesh2x4():
    return jax.make_mesh((2, 4), ("dp", "ep"))


@pytest.fixture
def streaming_stores():
    """Every result written with non-temporal stores (as JAXCOMM_NONTEMPORAL_BYTES=1)."""
    from jaxcomm import _jaxcomm
    before = _jaxcomm.nontemporal_bytes()
    _jaxcomm.set_nontemporal_bytes(1)
    yield
    _jaxcomm.set_nontemporal_bytes(before)


@pytest.fixture
def x64():
    """Enables 64-bit types for the duration of one test."""
    with jax.enable_x64(True):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist loadgroup``), the tests that share a module-scoped
    fixture (a job run once and inspected by several tests) go to one worker, so the job
    runs once per session rather than once per worker.

    First among the hooks: a worker of xdist turns the marks into group names in its own
    pytest_collection_modifyitems, registered after this conftest was loaded, so called
    before it unless this one goes first; the marks were then never seen, and each such
    job ran once per worker that got one of its tests, on both at once. (pytest 9.2 with
    pytest-xdist 3.8 ignores the groups even so: pyproject.toml keeps pytest below 9.2.)"""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d[-1].scope == "module" for d in defs if d):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts) on a GPU run: no workers. Each worker would
    start its own client on the GPU (and preallocate most of its memory)."""
    if any(p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu")):
        return 0
    return None
