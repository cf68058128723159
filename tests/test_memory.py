"""jaxcomm.memory(): what a process holds for its collectives, allocated on first use and
bounded by JAXCOMM_COMM_MEMORY_MB."""

from __future__ import annotations

import json

import jaxcomm
from mp_util import MPResult, assert_ok, run_script


def test_nothing_is_held_before_a_cross_process_program() -> None:
    m = jaxcomm.memory()
    assert (m.shm_control, m.shm_data, m.shm_data_used, m.link_buffers, m.staging, m.calls) == (0,) * 6, m
    assert m.limit == 1024 << 20
    assert m.total == m.recorder


# Four programs over the same 2 processes: `small` and `other` (64 KiB per rank), `never`
# (compiled, never run) and `big` (512 KiB per rank: 1 MiB of buffers, past a 1 MiB bound
# with the control block). Each step prints what memory() says.
STEPS = """
import json
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
def program(scale):
    return jax.jit(jax.shard_map(lambda v: jaxcomm.all_reduce(v * scale, "x"), mesh=mesh,
                                 in_specs=P("x"), out_specs=P("x"), check_vma=False))
def data(n):
    host = np.ones((2 * n,), np.float32)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda i: host[i])
def show(tag):
    print("MEM", json.dumps({"tag": tag, **jaxcomm.memory().as_dict()}), flush=True)
show("start")
small, other, never, big = program(1.0), program(2.0), program(3.0), program(4.0)
x = data(16384)
never.lower(x).compile()
show("compiled")
for _ in range(3):
    out = small(x)
np.testing.assert_array_equal(np.asarray(out.addressable_shards[0].data), np.full(16384, 2.0))
show("small")
other(x).block_until_ready()
show("other")
try:
    big(data(131072)).block_until_ready()
    print("BIG OK", flush=True)
except Exception as e:
    print("BIG ERROR", str(e).replace("\\n", " "), flush=True)
show("big")
"""


def _steps(res: MPResult) -> dict[int, dict[str, dict]]:
    """rank -> step -> what memory() said there; both ranks, every step."""
    out: dict[int, dict[str, dict]] = {}
    for rank, text in res.output.items():
        for line in text.splitlines():
            if line.startswith("MEM "):
                m = json.loads(line[4:])
                out.setdefault(rank, {})[m["tag"]] = m
    assert sorted(out) == [0, 1] and all(len(s) == 5 for s in out.values()), res.format()
    return out


def test_shared_memory_grows_per_call_used_and_stops_at_the_bound() -> None:
    res = run_script(STEPS, 2, 1, env={"JAXCOMM_COMM_MEMORY_MB": "1"}, timeout_s=120)
    assert_ok(res)
    for rank, m in _steps(res).items():
        # Lowering linked the peer (a control block) but no call holds buffers yet.
        assert m["compiled"]["shm_control"] > 0 and m["compiled"]["calls"] == 0, m["compiled"]
        assert m["compiled"]["shm_data"] == 0, m["compiled"]
        # One call run: two buffers of 64 KiB; the one never run holds nothing.
        assert m["small"]["calls"] == 1 and m["small"]["shm_data_used"] == 2 * 65536, m["small"]
        assert m["other"]["calls"] == 2 and m["other"]["shm_data_used"] == 4 * 65536, m["other"]
        # Segments within the bound, with the control block.
        for step in ("small", "other", "big"):
            assert m[step]["shm_control"] + m[step]["shm_data"] <= m[step]["limit"] == 1 << 20, m[step]
        assert m["big"]["calls"] == 2, m["big"]
        assert m["small"]["recorder"] > 0, m["small"]
        assert m["other"]["total"] == sum(m["other"][k] for k in (
            "shm_control", "shm_data", "link_buffers", "staging", "recorder"))
        line = next(l for l in res.output[rank].splitlines() if l.startswith("BIG"))
        assert line.startswith("BIG ERROR") and "JAXCOMM_COMM_MEMORY_MB=1" in line, line
        assert "1048576 bytes" in line, line


def test_tcp_links_hold_frames_not_shared_memory() -> None:
    res = run_script(STEPS, 2, 1, env={"JAXCOMM_TRANSPORT": "tcp"}, timeout_s=120)
    assert_ok(res)
    for rank, m in _steps(res).items():
        assert "BIG OK" in res.output[rank], res.format()
        assert m["big"]["shm_control"] == m["big"]["shm_data"] == m["big"]["calls"] == 0, m["big"]
        # The last rounds' frames, kept for the next ones: at most the two calls' and the
        # big one's, a few of each.
        assert 0 < m["big"]["link_buffers"] <= 8 * (2 * 65536 + 524288), m["big"]
