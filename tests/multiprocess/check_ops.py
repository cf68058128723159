"""Runs every jaxcomm collective over meshes that span processes, checked against NumPy.

Run by tests/test_multiprocess.py as the body of a launched job (tests/mp_util.py's
prologue defines RANK, NPROC, LOCAL, np, jax, jnp, P, jaxcomm). Each device holds a
(4, 6) block of a global array X of shape (partitions, 4, 6) that every process can
rebuild from the seed, so each process checks its own devices' results with NumPy.
Prints "CHECKED <name>" per case and raises on the first mismatch.
"""

import os

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomm


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


def run_case(name, mesh, axes, f, expected, block=(4, 6), donate=False, rtol=1e-5):
    """Runs f per device under shard_map; expected(X, group, rank) gives one block."""
    n = mesh.devices.size
    X = np.random.default_rng(7).standard_normal((n, *block)).astype(np.float32)
    spec = P(tuple(mesh.axis_names))
    sharding = NamedSharding(mesh, spec)
    flat = list(mesh.devices.reshape(-1))
    local = {d: X[flat.index(d)] for d in jax.local_devices() if d in flat}
    arr = jax.make_array_from_single_device_arrays(
        (n * block[0], block[1]), sharding, [jax.device_put(local[d], d) for d in local])
    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False),
                  donate_argnums=(0,) if donate else ())(arr)
    where = groups_of(mesh, axes)
    for shard in out.addressable_shards:
        p = flat.index(shard.device)
        group, rank = where[p]
        want = expected(X, group, rank)
        np.testing.assert_allclose(np.asarray(shard.data), want, rtol=rtol, atol=1e-5,
                                   err_msg=f"{name} on partition {p} (rank {rank} of {group})")
    print("CHECKED", name, flush=True)


def check_all(mesh, axes, tag):
    a = axes if len(axes) > 1 else axes[0]
    G = int(np.prod([mesh.shape[x] for x in axes]))
    run_case(f"{tag} all_reduce sum", mesh, axes, lambda x: jaxcomm.all_reduce(x, a),
             lambda X, g, r: X[g].sum(0))
    run_case(f"{tag} all_reduce max", mesh, axes, lambda x: jaxcomm.all_reduce(x, a, op="max"),
             lambda X, g, r: X[g].max(0))
    run_case(f"{tag} all_gather", mesh, axes,
             lambda x: jaxcomm.all_gather(x, a, tiled=True).reshape(G, 4, 6).sum(0) + jaxcomm.all_gather(x, a, tiled=True)[:4],
             lambda X, g, r: X[g].sum(0) + X[g[0]])
    chunks = lambda x: jnp.concatenate([x * (k + 1) + k for k in range(G)])
    run_case(f"{tag} reduce_scatter", mesh, axes,
             lambda x: jaxcomm.reduce_scatter(chunks(x), a, scatter_dimension=0, tiled=True),
             lambda X, g, r: (X[g] * (r + 1) + r).sum(0))
    run_case(f"{tag} all_to_all", mesh, axes,
             lambda x: jaxcomm.all_to_all(chunks(x), a, 0, 0, tiled=True).reshape(G, 4, 6)[::-1].sum(0) * 0 + jaxcomm.all_to_all(chunks(x), a, 0, 0, tiled=True)[-4:],
             lambda X, g, r: X[g[-1]] * (r + 1) + r)
    perm = [(i, (i + 1) % G) for i in range(G)]
    run_case(f"{tag} ppermute", mesh, axes, lambda x: jaxcomm.ppermute(x, a, perm),
             lambda X, g, r: X[g[(r - 1) % G]])
    run_case(f"{tag} broadcast", mesh, axes, lambda x: jaxcomm.broadcast(x, a, root=G - 1),
             lambda X, g, r: X[g[-1]])

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

    run_case(f"{tag} ragged_all_to_all", mesh, axes, ragged, ragged_expected)

    # MoE: each token goes to two experts (chosen from its values) with weights 0.25 and
    # 0.5; with the identity as every expert, combine(dispatch(x)) is 0.75 x, in both
    # layouts.
    E = 2 * G

    def routing(x):
        r = jax.lax.axis_index(a)
        t = jnp.arange(x.shape[0])
        first = (t * 3 + r) % E
        ids = jnp.stack([first, (first + 1 + t % (E - 1)) % E], axis=1).astype(jnp.int32)
        return ids, jnp.broadcast_to(jnp.asarray([0.25, 0.5], x.dtype), ids.shape)

    def moe_packed(x):
        ids, w = routing(x)
        ex, _, h = jaxcomm.moe.dispatch(x, ids, num_experts=E, axis_name=a)
        return jaxcomm.moe.combine(ex, h, w)

    def moe_padded(x):
        ids, w = routing(x)
        ex, _, h = jaxcomm.moe.dispatch_padded(x, ids, num_experts=E, axis_name=a)
        return jaxcomm.moe.combine_padded(ex, h, w)

    run_case(f"{tag} moe dispatch/combine", mesh, axes, moe_packed, lambda X, g, r: 0.75 * X[g[r]])
    run_case(f"{tag} moe padded", mesh, axes, moe_padded, lambda X, g, r: 0.75 * X[g[r]])


def check_streamed(mesh, axes, tag):
    """Operands of over 1 MiB per rank: across processes of one host these stream through
    shared memory in chunks (ffi/cpu/world_stream.cc); 301 columns make the last chunk,
    and the reduce_scatter and all_to_all blocks, end mid-chunk."""
    a = axes if len(axes) > 1 else axes[0]
    G = int(np.prod([mesh.shape[x] for x in axes]))
    rows, cols = 1000, 301
    big = (rows, cols)
    run_case(f"{tag} streamed all_reduce sum", mesh, axes, lambda x: jaxcomm.all_reduce(x, a),
             lambda X, g, r: X[g].sum(0), big)
    # Donated: too large to reuse the operand's buffer (primitive.ALIAS_MAX_BYTES), XLA
    # must still keep the donated operand intact until the call has read it.
    run_case(f"{tag} streamed all_reduce in place", mesh, axes, lambda x: jaxcomm.all_reduce(x, a),
             lambda X, g, r: X[g].sum(0), big, donate=True)
    run_case(f"{tag} streamed all_reduce max", mesh, axes, lambda x: jaxcomm.all_reduce(x, a, op="max"),
             lambda X, g, r: X[g].max(0), big)
    # Half precision is summed in float32 and rounded once, on every path.
    bf16 = jnp.bfloat16
    run_case(f"{tag} streamed all_reduce bfloat16", mesh, axes,
             lambda x: jaxcomm.all_reduce(x.astype(bf16), a).astype(jnp.float32),
             lambda X, g, r: X[g].astype(bf16).astype(np.float32).sum(0).astype(bf16).astype(np.float32),
             big, rtol=8e-3)
    run_case(f"{tag} streamed all_gather", mesh, axes,
             lambda x: jaxcomm.all_gather(x, a, tiled=True).reshape(G, rows, cols).sum(0),
             lambda X, g, r: X[g].sum(0), big)
    scaled = lambda x: jnp.concatenate([x * (k + 1) + k for k in range(G)])
    run_case(f"{tag} streamed reduce_scatter", mesh, axes,
             lambda x: jaxcomm.reduce_scatter(scaled(x), a, scatter_dimension=0, tiled=True),
             lambda X, g, r: (X[g] * (r + 1) + r).sum(0), big)
    run_case(f"{tag} streamed all_to_all", mesh, axes,
             lambda x: jaxcomm.all_to_all(scaled(x), a, 0, 0, tiled=True).reshape(G, rows, cols)[0],
             lambda X, g, r: X[g[0]] * (r + 1) + r, big)
    # Rank 0 receives from nobody: zeros.
    perm = [(i, i + 1) for i in range(G - 1)]
    run_case(f"{tag} streamed ppermute", mesh, axes, lambda x: jaxcomm.ppermute(x, a, perm),
             lambda X, g, r: X[g[r - 1]] if r > 0 else np.zeros(big, np.float32), big)
    # They did stream, unless TCP was forced, the processes play several hosts, or the
    # group has more processes than the host has cores (streams wait by spinning).
    streamed = {s.op for s in jaxcomm.stats() if s.algorithm == "shm stream"}
    one_host = os.environ.get("JAXCOMM_TRANSPORT") != "tcp" and "JAXCOMM_HOST_ID" not in os.environ
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
    scattered = {s.op for s in jaxcomm.stats() if s.algorithm == "tcp reduce-scatter+all-gather"}
    tcp = os.environ.get("JAXCOMM_TRANSPORT") == "tcp"
    assert scattered == ({"all_reduce"} if tcp and NPROC >= 3 else set()), (
        tag, scattered, [(s.op, s.algorithm, s.bytes) for s in jaxcomm.stats()])


devices = np.asarray(jax.devices()).reshape(NPROC, LOCAL)
if LOCAL > 1:
    # "p" crosses processes, "l" stays in one; the pair mixes both.
    mesh2 = jax.sharding.Mesh(devices, ("p", "l"))
    check_all(mesh2, ("p",), "p")
    check_all(mesh2, ("l",), "l")
    check_all(mesh2, ("p", "l"), "pl")
    # Groups that hold one device of each process, in an order unlike the processes'.
    mesh_t = jax.sharding.Mesh(devices.T[:, ::-1], ("l", "p"))
    check_all(mesh_t, ("p",), "transposed p")
    # Both axes, "l" first: each process's ranks are not adjacent in the group.
    check_all(mesh_t, ("l", "p"), "transposed lp")
    check_streamed(mesh2, ("p", "l"), "pl")
    check_streamed(mesh_t, ("p",), "transposed p")
else:
    mesh1 = jax.sharding.Mesh(devices.reshape(-1)[::-1], ("x",))
    check_all(mesh1, ("x",), "x")
    check_streamed(mesh1, ("x",), "x")
if "JAXCOMM_HOST_ID" in os.environ and NPROC >= 4:
    # Two processes per "host": every op that crossed hosts went in phases (all_reduce
    # reduced within each host first, the others relayed by the hosts' leaders), but the
    # large all_to_all and reduce_scatter along dimension 0 and ppermute (the "streamed"
    # cases), which send each process just what its ranks read.
    algorithms = {(s.op, s.algorithm) for s in jaxcomm.stats()}
    flat = {op for op, a in algorithms if a == "shm+tcp"}
    assert flat == {"reduce_scatter", "all_to_all", "ppermute"}, algorithms
    hierarchical = {op for op, a in algorithms if a == "hierarchical shm+tcp"}
    assert hierarchical == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute",
                            "broadcast", "ragged_all_to_all", "moe_transport", "moe_dispatch"}, algorithms
    print("CHECKED hierarchical", flush=True)
print("ALL CHECKED", flush=True)
