"""jaxcomm: collectives and MoE expert-parallel dispatch/combine for JAX.

The ops run inside ``jax.shard_map`` (under ``jax.jit``) over mesh axes, with the
semantics of their ``jax.lax`` namesakes; on CPU they are jaxcomm's own XLA FFI
handlers. See README.md for the API table, docs/ for the rest (docs/configuration.md: the
environment variables; docs/design.md: how it works). ``jaxcomm.lax`` has jax.lax's
collectives with jax.lax's signatures and results, and ``jaxcomm.use_for_lax()`` routes
``jax.lax``'s own names there (docs/lax.md).
"""

try:
    from jaxcomm import _jaxcomm  # noqa: F401  (the C++ extension every op needs)
except ImportError as _missing:  # pragma: no cover - depends on how jaxcomm was found
    import os as _os

    raise ImportError(
        "jaxcomm's compiled extension (_jaxcomm) is missing from "
        f"{_os.path.dirname(_os.path.abspath(__file__))}. That is a source tree, not an "
        "installed jaxcomm: Python found it first because the current directory (or "
        "PYTHONPATH) holds it. Install it with `pip install .` and run from another "
        "directory, or copy a built _jaxcomm*.so into that folder."
    ) from _missing

from jaxcomm._src.distributed import init
from jaxcomm._src.ops.alltoall import all_to_all
from jaxcomm._src.ops.broadcast import broadcast
from jaxcomm._src.ops.gather import all_gather
from jaxcomm._src.ops.permute import ppermute
from jaxcomm._src.ops.ragged import ragged_all_to_all
from jaxcomm._src.ops.reduce import all_reduce, reduce_scatter

from jaxcomm import ft, moe  # noqa: E402  (jaxcomm.ft.all_reduce, jaxcomm.moe.dispatch / combine)
from jaxcomm import tp  # noqa: E402  (jaxcomm.tp.all_gather_matmul, matmul_reduce_scatter, put_start / put_done)
from jaxcomm import lax  # noqa: E402  (jax.lax's collectives, computed by jaxcomm)
from jaxcomm._src.dropin.switch import LaxSwitch, use_for_lax  # noqa: E402
from jaxcomm import trace  # noqa: E402  (flight recorder: dump, analyze, export)
from jaxcomm._src.stats import reset_stats, stats  # noqa: E402
from jaxcomm._src.memory import CommMemory, memory  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "ft",
    "CommMemory",
    "init",
    "lax",
    "LaxSwitch",
    "memory",
    "moe",
    "ppermute",
    "ragged_all_to_all",
    "reduce_scatter",
    "reset_stats",
    "stats",
    "tp",
    "trace",
    "use_for_lax",
]

from jaxcomm._src import roofline as _roofline  # noqa: E402

_roofline.register()  # jax.experimental.roofline's rules for jaxcomm's collectives, where absl is
