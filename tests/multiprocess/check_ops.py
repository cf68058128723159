"""Runs every jaxcomm collective over meshes that span processes, checked against NumPy.

Run by tests/test_multiprocess.py as the body of a launched job (tests/mp_util.py's
prologue defines RANK, NPROC, LOCAL, np, jax, jnp, P, jaxcomm). Device k of a mesh (in
the order of its flattened devices) holds block X[k] of a global array X that every
process rebuilds from the seed, so each process checks every element of its own devices'
results against a NumPy reference computed from the global data. Prints "CHECKED <tag>
<name>" per case and raises on the first mismatch.

The cases of one mesh and axis run as one program (independent collectives, which XLA
runs in any order on each device): one compilation per group instead of one per op.
"""

import functools
import os

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm
from jaxcomm._src import mpi

# The transport between hosts: MPI under an MPI launcher (jaxcomm/_src/mpi.py), else TCP.
ACROSS = "mpi" if mpi.wanted() else "tcp"

BLOCK = (4, 6)       # each device's block in the small cases
BIG = (1000, 301)    # over 1 MiB of float32 per rank: streamed between 2 processes
# Half-precision blocks of over 1 MiB too, rows divisible by every group size up to 8,
# with more than 2048 elements in every rank's share of a reduce_scatter.
BIG_HALF = (2016, 301)


def groups_of(mesh, axes):
    """partition -> (group as partitions in rank order, rank), for a collective over axes."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    names = list(mesh.axis_names)
    order = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in order]
    moved = np.transpose(ids, rest + order).reshape(-1, int(np.prod([ids.shape[i] for i in order])))
    where = {}
    for g in moved:
        for r, p in enumerate(g):
            where[int(p)] = (list(map(int, g)), r)
    return where


# The data are made once per shape (both meshes of a job check the same arrays): in
# every process of the job, the half-precision arrays took a second of CPU each time.
@functools.cache
def global_data(n, block, seed=7):
    """Multiples of 1/8 in [-128, 128): 2048 distinct values, whose sums (and the scaled
    chunks of the cases below) are exact in float32 in any order and however XLA fuses the
    arithmetic, so that data movement and sums compare exactly. Shared: read-only."""
    return _read_only((np.random.default_rng(seed).integers(-1024, 1024, size=(n, *block)) / 8
                       ).astype(np.float32))


@functools.cache
def narrow_half(n, block, dtype, seed=8):
    """Half-precision values of magnitude 0.5 to 8: the sum of up to 8 of them is exact in
    float32 whatever the order, so a sum rounded once to ``dtype`` has one right answer.
    Drawn in float32 (half the work of float64; the values are rounded to ``dtype``
    anyway). Shared: read-only."""
    rng = np.random.default_rng(seed)
    mag = rng.random((n, *block), dtype=np.float32) * np.float32(7.5) + np.float32(0.5)
    return _read_only(np.where(rng.random((n, *block), dtype=np.float32) < 0.5, -mag, mag
                               ).astype(dtype))


def _read_only(x):
    x.setflags(write=False)
    return x


# The processes run on several hosts: played (JAXCOMM_HOST_ID) or real (network
# namespaces, tests/test_netns.py, which says so in CHECK_OPS_HOSTS: jaxcomm must find
# the hosts itself there).
SEVERAL_HOSTS = "JAXCOMM_HOST_ID" in os.environ or int(os.environ.get("CHECK_OPS_HOSTS", "1")) > 1
# ... each process on a host of its own: every link is TCP.
ONE_PER_HOST = int(os.environ.get("CHECK_OPS_HOSTS", "1")) == NPROC > 1

_programs = 0


def compile_once(lowered):
    """``lowered.compile()``, compiled by process 0 only: the others load its executable
    (jax.experimental.serialize_executable, through the job's key-value store). Every
    process compiles the same program, and with more processes than cores, compiling it
    in each at once took most of the job's time."""
    global _programs
    _programs += 1
    if NPROC == 1:
        return lowered.compile()
    from jax.experimental import serialize_executable
    from jaxcomm._src import distributed
    kv, key = distributed.kv_client(), f"check_ops/executable/{_programs}"
    if RANK == 0:
        compiled = lowered.compile()
        payload, _, _ = serialize_executable.serialize(compiled)
        kv.key_value_set_bytes(key, payload)
        return compiled
    payload = kv.blocking_key_value_get_bytes(key, 600_000)
    return serialize_executable.deserialize_and_load(payload, lowered.in_tree, lowered.out_tree)


def run_cases(tag, mesh, axes, X, cases, donate=False):
    """Runs every case in one program; checks every element of every local result.

    Args:
      X: the global data, one block per device of ``mesh`` (flattened order).
      cases: name -> (f, expected, tolerance): f maps a device's block to its result, or
        to a tuple of results (each with at least one dimension); expected(X, group,
        rank) gives the same in NumPy. Tolerance None compares exactly, a number is the
        rtol (and atol) of a float comparison; a tuple gives one per result.
    """
    n = mesh.devices.size
    spec = P(tuple(mesh.axis_names))
    flat = list(mesh.devices.reshape(-1))
    local = [d for d in jax.local_devices() if d in flat]
    arr = jax.make_array_from_single_device_arrays(
        (n * X.shape[1], *X.shape[2:]), NamedSharding(mesh, spec),
        [jax.device_put(X[flat.index(d)], d) for d in local])
    names = list(cases)
    body = lambda x: tuple(cases[name][0](x) for name in names)
    out = compile_once(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                             check_vma=False),
                               donate_argnums=(0,) if donate else ()).lower(arr))(arr)
    where = groups_of(mesh, axes)
    for name, results in zip(names, out):
        _, expected, tols = cases[name]
        several = isinstance(results, tuple)
        results = results if several else (results,)
        tols = tols if isinstance(tols, tuple) else (tols,) * len(results)
        for shard_index in range(len(results[0].addressable_shards)):
            device = results[0].addressable_shards[shard_index].device
            p = flat.index(device)
            group, rank = where[p]
            wants = expected(X, group, rank)
            wants = wants if several else (wants,)
            for i, (result, want, tol) in enumerate(zip(results, wants, tols)):
                shard = next(s for s in result.addressable_shards if s.device == device)
                got, want = np.asarray(shard.data), np.asarray(want)
                msg = (f"{tag} {name}" + (f" result {i}" if several else "") +
                       f" on partition {p} (rank {rank} of {group})")
                assert got.shape == want.shape and got.dtype == want.dtype, (
                    msg, got.shape, want.shape, got.dtype, want.dtype)
                if tol is None:
                    np.testing.assert_array_equal(got, want, err_msg=msg)
                else:
                    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=msg)
        print("CHECKED", tag, name, flush=True)


def scaled(x, G, axis=0):
    """G chunks of x along ``axis``, chunk k = x * (k + 1) + k."""
    return jnp.concatenate([x * (k + 1) + k for k in range(G)], axis=axis)


# ------------------------------------------------------------------------------- MoE

T, K = BLOCK[0], 2


def moe_routing(r, E, xp=np):
    """Rank r's expert ids [T, K] (two distinct experts per token) and weights [T, K]
    (distinct per token and slot)."""
    t = xp.arange(T)
    first = (t * 3 + r) % E
    ids = xp.stack([first, (first + 1 + t % (E - 1)) % E], axis=1).astype(xp.int32)
    w = ((1 + t[:, None] * K + xp.arange(K)[None, :] + r) / 8.0).astype(xp.float32)
    return ids, w


def expert(e, rows):
    """Expert e's function: distinct per expert (rows: [..., H], e broadcast over them)."""
    return rows * (e + 1.0) + 0.5 * e


def moe_expected(X, g, d, E, padded):
    """Rank d's dispatched rows (packed or padded layout) and combined output."""
    G, El = len(g), E // len(g)
    routes = [moe_routing(s, E) for s in range(G)]
    slabs = []
    for el in range(El):
        e = d * El + el
        slabs.append([X[g[s]][t] for s in range(G) for t in range(T) for k in range(K)
                      if routes[s][0][t, k] == e])
    H = X.shape[-1]
    if padded:
        ex = np.zeros((El, G * T, H), np.float32)
        for el, rows in enumerate(slabs):
            ex[el, :len(rows)] = rows
    else:
        ex = np.zeros((G * T * min(K, El), H), np.float32)
        rows = [row for slab in slabs for row in slab]
        ex[:len(rows)] = rows
    ids, w = routes[d]
    y = (w[:, :, None] * expert(ids[:, :, None].astype(np.float32), X[g[d]][:, None, :])).sum(1)
    return ex, np.asarray([len(s) for s in slabs], np.int32), y


def moe_cases(a, G):
    E = 2 * G
    El = E // G

    def layer(x, padded):
        r = jax.lax.axis_index(a)
        ids, w = moe_routing(r, E, jnp)
        if padded:
            ex, sizes, h = jaxcomm.moe.dispatch_padded(x, ids, num_experts=E, axis_name=a)
            e = (r * El + jnp.arange(El, dtype=jnp.float32))[:, None, None]
            return ex, sizes, jaxcomm.moe.combine_padded(expert(e, ex), h, w)
        ex, sizes, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name=a)
        # Row i belongs to local expert el where the running sizes first exceed i.
        el = jnp.sum(jnp.arange(ex.shape[0])[:, None] >= jnp.cumsum(sizes)[None, :], axis=1)
        e = (r * El + el).astype(jnp.float32)[:, None]
        return ex, sizes, jaxcomm.moe.combine(expert(e, ex), h, w)

    return {f"moe {'padded' if padded else 'packed'}": (
        lambda x, padded=padded: layer(x, padded),
        lambda X, g, r, padded=padded: moe_expected(X, g, r, E, padded),
        None) for padded in (False, True)}


# ---------------------------------------------------------------------------- checks

def check_all(mesh, axes, tag, moe=("packed", "padded")):
    """Every op over ``axes`` of ``mesh``; the MoE transport in the ``moe`` layouts (its
    programs take several times longer to compile than all the other ops together)."""
    a = axes if len(axes) > 1 else axes[0]
    G = int(np.prod([mesh.shape[x] for x in axes]))
    perm = [(i, (i + 1) % G) for i in range(G)]

    # Rank s sends rows [0, (s + d) % 3 + 1) of its block to rank d, at rows 4 s of d's output.
    def ragged(x):
        r = jax.lax.axis_index(a)
        ks = jnp.arange(G, dtype=jnp.int32)
        sizes = (r + ks) % 3 + 1
        return jaxcomm.ragged_all_to_all(
            jnp.tile(x, (G, 1)), jnp.zeros((4 * G, 6), x.dtype), 4 * ks, sizes,
            jnp.full((G,), 4 * r, jnp.int32), sizes, axis_name=a)

    def ragged_expected(X, g, d):
        out = np.zeros((4 * G, 6), np.float32)
        for s, p in enumerate(g):
            n = (s + d) % 3 + 1
            out[4 * s:4 * s + n] = X[p][:n]
        return out

    # Chunk k of rank s's operand goes to rank k: rank r receives chunk r of every rank,
    # scaled (r + 1) and shifted by r, in rank order.
    def a2a_expected(X, g, r, axis):
        return np.concatenate([X[p] * (r + 1) + r for p in g], axis=axis)

    cases = {
        "all_reduce sum": (lambda x: jaxcomm.all_reduce(x, a), lambda X, g, r: X[g].sum(0), None),
        "all_reduce max": (lambda x: jaxcomm.all_reduce(x, a, op="max"),
                           lambda X, g, r: X[g].max(0), None),
        "all_reduce prod": (lambda x: jaxcomm.all_reduce(x, a, op="prod"),
                            lambda X, g, r: X[g].prod(0), 1e-5),
        "all_gather": (lambda x: jaxcomm.all_gather(x, a, tiled=True),
                       lambda X, g, r: np.concatenate(X[g]), None),
        "all_gather axis 1": (lambda x: jaxcomm.all_gather(x, a, axis=1),
                              lambda X, g, r: np.stack(X[g], axis=1), None),
        "reduce_scatter": (lambda x: jaxcomm.reduce_scatter(scaled(x, G), a, scatter_dimension=0,
                                                            tiled=True),
                           lambda X, g, r: (X[g] * (r + 1) + r).sum(0), None),
        "reduce_scatter dim 1": (lambda x: jaxcomm.reduce_scatter(scaled(x, G, 1), a,
                                                                  scatter_dimension=1, tiled=True),
                                 lambda X, g, r: (X[g] * (r + 1) + r).sum(0), None),
        "all_to_all": (lambda x: jaxcomm.all_to_all(scaled(x, G), a, 0, 0, tiled=True),
                       lambda X, g, r: a2a_expected(X, g, r, 0), None),
        "all_to_all split 1 concat 0": (
            lambda x: jaxcomm.all_to_all(scaled(x, G, 1), a, 1, 0, tiled=True),
            lambda X, g, r: a2a_expected(X, g, r, 0), None),
        "ppermute": (lambda x: jaxcomm.ppermute(x, a, perm),
                     lambda X, g, r: X[g[(r - 1) % G]], None),
        "broadcast": (lambda x: jaxcomm.broadcast(x, a, root=G - 1),
                      lambda X, g, r: X[g[-1]], None),
        "ragged_all_to_all": (ragged, ragged_expected, None),
        **{name: case for name, case in moe_cases(a, G).items() if name.split()[1] in moe},
    }
    run_cases(tag, mesh, axes, global_data(mesh.devices.size, BLOCK), cases)


def check_streamed(mesh, axes, tag):
    """Operands of over 1 MiB per rank: across processes of one host these stream through
    shared memory in chunks (ffi/cpu/transport/world_stream.cc); 301 columns make the last chunk,
    and the reduce_scatter and all_to_all blocks, end mid-chunk."""
    a = axes if len(axes) > 1 else axes[0]
    G = int(np.prod([mesh.shape[x] for x in axes]))
    n = mesh.devices.size
    X = global_data(n, BIG)
    # Rank 0 receives from nobody: zeros.
    perm = [(i, i + 1) for i in range(G - 1)]
    run_cases(f"{tag} streamed", mesh, axes, X, {
        "all_reduce sum": (lambda x: jaxcomm.all_reduce(x, a), lambda X, g, r: X[g].sum(0), None),
        "all_reduce max": (lambda x: jaxcomm.all_reduce(x, a, op="max"),
                           lambda X, g, r: X[g].max(0), None),
        "all_gather": (lambda x: jaxcomm.all_gather(x, a, tiled=True),
                       lambda X, g, r: np.concatenate(X[g]), None),
        "reduce_scatter": (lambda x: jaxcomm.reduce_scatter(scaled(x, G), a, scatter_dimension=0,
                                                            tiled=True),
                           lambda X, g, r: (X[g] * (r + 1) + r).sum(0), None),
        "all_to_all": (lambda x: jaxcomm.all_to_all(scaled(x, G), a, 0, 0, tiled=True),
                       lambda X, g, r: np.concatenate([X[p] * (r + 1) + r for p in g]), None),
        "ppermute": (lambda x: jaxcomm.ppermute(x, a, perm),
                     lambda X, g, r: X[g[r - 1]] if r > 0 else np.zeros(BIG, np.float32), None),
    })
    # Donated: too large to reuse the operand's buffer (primitive.ALIAS_MAX_BYTES), XLA
    # must still keep the donated operand intact until the call has read it.
    run_cases(f"{tag} streamed donated", mesh, axes, X, {
        "all_reduce in place": (lambda x: jaxcomm.all_reduce(x, a), lambda X, g, r: X[g].sum(0),
                                None)}, donate=True)
    # Half precision is summed in float32 and rounded once, on every path: exactly the
    # correctly rounded sum for these values.
    for dtype in (jnp.float16, jnp.bfloat16):
        name = np.dtype(dtype).name
        exact_sum = lambda X, g: X[g].astype(np.float64).sum(0).astype(X.dtype)
        run_cases(f"{tag} streamed {name}", mesh, axes, narrow_half(n, BIG_HALF, dtype), {
            "all_reduce": (lambda x: jaxcomm.all_reduce(x, a),
                            lambda X, g, r: exact_sum(X, g), None),
            "reduce_scatter": (
                lambda x: jaxcomm.reduce_scatter(x, a, scatter_dimension=0, tiled=True),
                lambda X, g, r: np.split(exact_sum(X, g), G)[r], None),
        })
    # They did stream, unless TCP was forced, the processes play several hosts, or the
    # group has more processes than the host has cores (streams wait by spinning).
    streamed = {s.op for s in jaxcomm.stats() if s.algorithm == "shm stream"}
    one_host = os.environ.get("JAXCOMM_TRANSPORT") != "tcp" and not SEVERAL_HOSTS
    want = set() if not one_host or NPROC > os.cpu_count() else {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute"}
    assert streamed == want, (tag, streamed, [(s.op, s.algorithm, s.bytes) for s in jaxcomm.stats()])
    # Streams read the peers' operands straight from their memory wherever every
    # process of the round may (and did not turn it off), else through the ring.
    from jaxcomm import _jaxcomm
    direct = _jaxcomm.single_copy() and all(_jaxcomm.transport_direct(p) for p in range(NPROC) if p != RANK)
    assert (_jaxcomm.single_copy_rounds() > 0) == bool(want and direct), (
        tag, _jaxcomm.single_copy_rounds(), direct)
    # Over TCP among three or more processes, the large all_reduces ran as a
    # reduce-scatter then an all-gather (ffi/core/scatter_gather.cc).
    scattered = {s.op for s in jaxcomm.stats() if s.algorithm == f"{ACROSS} reduce-scatter+all-gather"}
    tcp = os.environ.get("JAXCOMM_TRANSPORT") == "tcp" or ONE_PER_HOST
    assert scattered == ({"all_reduce"} if tcp and NPROC >= 3 else set()), (
        tag, scattered, [(s.op, s.algorithm, s.bytes) for s in jaxcomm.stats()])


devices = np.asarray(jax.devices()).reshape(NPROC, LOCAL)
if LOCAL > 1:
    # "p" crosses processes, "l" stays in one; the pair mixes both. Each MoE layout runs
    # over two of the groups that cross processes (within a process: tests/test_moe.py).
    mesh2 = jax.sharding.Mesh(devices, ("p", "l"))
    check_all(mesh2, ("p",), "p", moe=("packed",))
    check_all(mesh2, ("l",), "l", moe=())
    check_all(mesh2, ("p", "l"), "pl", moe=("padded",))
    # Groups that hold one device of each process, in an order unlike the processes'.
    mesh_t = jax.sharding.Mesh(devices.T[:, ::-1], ("l", "p"))
    check_all(mesh_t, ("p",), "transposed p", moe=("padded",))
    # Both axes, "l" first: each process's ranks are not adjacent in the group.
    check_all(mesh_t, ("l", "p"), "transposed lp", moe=("packed",))
    check_streamed(mesh2, ("p", "l"), "pl")
    check_streamed(mesh_t, ("p",), "transposed p")
else:
    mesh1 = jax.sharding.Mesh(devices.reshape(-1)[::-1], ("x",))
    check_all(mesh1, ("x",), "x")
    check_streamed(mesh1, ("x",), "x")
if SEVERAL_HOSTS and NPROC >= 4:
    # Two processes per "host": every op that crossed hosts went in phases (all_reduce
    # reduced within each host first, the others relayed by the hosts' leaders), but the
    # large all_to_all and reduce_scatter along dimension 0 and ppermute (the "streamed"
    # cases), which send each process just what its ranks read.
    algorithms = {(s.op, s.algorithm) for s in jaxcomm.stats()}
    flat = {op for op, a in algorithms if a == f"shm+{ACROSS}"}
    assert flat == {"reduce_scatter", "all_to_all", "ppermute"}, algorithms
    hierarchical = {op for op, a in algorithms if a == f"hierarchical shm+{ACROSS}"}
    assert hierarchical == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute",
                            "broadcast", "ragged_all_to_all", "moe_transport", "moe_dispatch"}, algorithms
    print("CHECKED hierarchical", flush=True)
print("ALL CHECKED", flush=True)
