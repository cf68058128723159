"""The flight-recorder analyzer on dumps written by hand: each verdict names exactly the
call and the ranks at fault, and ``python -m jaxcomm.trace analyze`` prints it first and
exits with its status.

The dumps follow the recorder's format (ffi/core/flight_recorder.cc, DumpJson; its schema
is checked against real dumps in test_trace.py). The job here has 4 ranks in 2
processes: process 0 holds partitions 0 and 1, process 1 partitions 2 and 3.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterable

import pytest

from jaxcomm.trace import __main__ as trace_cli
from jaxcomm.trace import analyzer, ringfile

PROCESS_OF = {0: 0, 1: 0, 2: 1, 3: 1}
PIDS = {0: 1000, 1: 1001}
GROUP = (0, 1, 2, 3)
SITE = "train.py:12 (step)"
T0 = 1_000_000_000  # microseconds: when the job's first call started
S = 1_000_000       # one second in microseconds


def entry(partition: int, execution: int, *, at: float, op: str = "all_reduce",
          state: str = "done", error: str | None = None, instruction: str = "00000000000000a1",
          dtype: str = "float32", nbytes: int = 16, left_out: Iterable[int] = (),
          group: tuple[int, ...] = GROUP, call_site: str = SITE) -> dict[str, Any]:
    """One recorder entry: ``partition``'s part in call ``execution`` of ``instruction``,
    enqueued ``at`` seconds after T0 (and lasting a millisecond if it completed)."""
    enq = T0 + int(at * S)
    done = state in ("done", "failed")
    return dict(partition=partition, seq=0, op=op, axis="'x'", call_site=call_site,
                instruction=instruction, group_index=0, group=list(group),
                processes=sorted({PROCESS_OF[p] for p in group}), rank=group.index(partition),
                execution=execution, run_id=execution, dtype=dtype, elements=nbytes // 4,
                bytes=nbytes, algorithm="shm", left_out=list(left_out), state=state,
                error=error, enqueue_us=enq, start_us=enq if done else None,
                end_us=enq + 1000 if done else None)


def done_calls(executions: Iterable[int], ranks: Iterable[int] = GROUP, start: float = 0.0,
               **kw: Any) -> list[dict[str, Any]]:
    """Completed calls, every rank arriving within a millisecond, one per 10 ms."""
    return [entry(p, e, at=start + 0.01 * e + 0.0002 * p, **kw)
            for e in executions for p in ranks]


def write_dumps(directory: pathlib.Path, entries: list[dict[str, Any]],
                processes: Iterable[int] = (0, 1), dumped_at: float = 10.0) -> pathlib.Path:
    """Writes one dump per process in ``processes`` with its partitions' entries."""
    directory.mkdir(exist_ok=True)
    for proc in processes:
        mine = [dict(e) for e in entries if PROCESS_OF[e["partition"]] == proc]
        for part in {e["partition"] for e in mine}:
            ordered = sorted((e for e in mine if e["partition"] == part), key=lambda e: e["enqueue_us"])
            for seq, e in enumerate(ordered, 1):
                e["seq"] = seq
        doc = dict(format="jaxcomm-trace", version=1, reason="error", process_index=proc,
                   pid=PIDS[proc], host=f"host{proc}", dumped_at_us=T0 + int(dumped_at * S),
                   entries_per_rank=2048, enabled=True,
                   ranks=[dict(partition=p, calls=sum(e["partition"] == p for e in mine))
                          for p in sorted({e["partition"] for e in mine})],
                   entries=mine)
        (directory / f"jaxcomm-trace-p{proc}-{PIDS[proc]}.json").write_text(json.dumps(doc))
    return directory


def timed_out(waiting_for: Iterable[int]) -> str:
    return (f"jaxcomm.all_reduce over axis 'x' (group 0 = partitions [0 1 2 3]), call site {SITE}: "
            f"timed out after 2 s (timeout_s / JAXCOMM_TIMEOUT_S) waiting for ranks "
            f"{list(waiting_for)}")


def top(report: analyzer.Report) -> analyzer.Finding:
    assert report.findings, report.text()
    return report.findings[0]


# ----------------------------------------------------------------------------- verdicts

def test_clean(tmp_path):
    report = analyzer.analyze(write_dumps(tmp_path / "d", done_calls(range(1, 4))))
    assert (report.kind, report.exit_code, report.calls) == ("clean", 0, 3), report.text()
    assert report.processes == [0, 1] and report.ranks == [0, 1, 2, 3]
    assert report.verdict.startswith("verdict: clean: 3 calls on 4 ranks in 2 process(es)")
    assert report.findings == []


def test_hang_names_the_rank_that_never_arrived(tmp_path):
    # Execution 3: ranks 0, 1 and 3 timed out waiting; rank 2 never came. A straggler at
    # execution 1 is less serious: the verdict is the hang.
    entries = done_calls(range(1, 3))
    entries[1]["enqueue_us"] += int(0.5 * S)  # rank 1, execution 1: 0.5 s late
    entries += [entry(p, 3, at=1.0, state="failed", error=timed_out([2])) for p in (0, 1, 3)]
    report = analyzer.analyze(write_dumps(tmp_path / "d", entries))
    assert (report.kind, report.exit_code) == ("hang", 1), report.text()
    f = top(report)
    assert (f.op, f.execution, f.call_site, f.culprits, f.waiting) == (
        "all_reduce", 3, SITE, [2], [0, 1, 3]), report.text()
    assert f.summary == (f"ranks [2] never arrived at all_reduce at {SITE} (axis 'x', execution 3); "
                         f"ranks [0, 1, 3] waited for them and timed out")
    assert f"rank 2: its last call was all_reduce at {SITE} (execution 2), done" in f.details
    assert [g.kind for g in report.findings] == ["hang", "straggler"]
    assert report.findings[1].culprits == [1]


def test_ranks_still_waiting_at_dump_time(tmp_path):
    # Dumped (by SIGUSR1) 6 s after ranks 0, 1 and 3 entered execution 2; rank 2 is not there.
    entries = done_calls([1]) + [entry(p, 2, at=4.0, state="pending") for p in (0, 1, 3)]
    d = write_dumps(tmp_path / "d", entries, dumped_at=10.0)
    f = top(analyzer.analyze(d, stuck_s=5))
    assert (f.kind, f.execution, f.culprits, f.waiting) == ("hang", 2, [2], [0, 1, 3])
    assert "timed out" not in f.summary
    # Waiting less than stuck_s is not yet a fault.
    assert analyzer.analyze(d, stuck_s=7).kind == "clean"


def test_rank_later_than_the_deadline(tmp_path):
    # Rank 2 came 3 s after the others had given up at their 2 s deadline.
    late = "jaxcomm.all_reduce over axis 'x': rank 2 arrived too late"
    entries = done_calls([1]) + [entry(p, 2, at=1.0, state="failed", error=timed_out([2]))
                                 for p in (0, 1, 3)]
    entries.append(entry(2, 2, at=4.0, state="failed", error=late))
    f = top(analyzer.analyze(write_dumps(tmp_path / "d", entries)))
    assert (f.kind, f.execution, f.culprits, f.waiting) == ("hang", 2, [2], [0, 1, 3])
    assert f.summary.startswith(f"ranks [2] arrived at all_reduce at {SITE} (axis 'x', execution 2) "
                                f"3.00 s after the first rank"), f.summary


@pytest.mark.parametrize("why", ["it exited before it arrived at this call",
                                 "connection closed by the peer (its process exited?)"])
def test_dead_process_without_a_dump(tmp_path, why):
    error = (f"jaxcomm.all_reduce over axis 'x' (group 0 = partitions [0 1 2 3]), rank 0: "
             f"process 1 (host host1 (10.0.0.2), pid 1001) with ranks [2 3] (partitions [2 3]) "
             f"failed: {why}")
    entries = done_calls(range(1, 3)) + [entry(p, 3, at=1.0, state="failed", error=error)
                                         for p in (0, 1)]
    report = analyzer.analyze(write_dumps(tmp_path / "d", entries, processes=[0]))
    assert (report.kind, report.exit_code, report.processes) == ("dead", 1, [0]), report.text()
    f = top(report)
    assert (f.op, f.execution, f.culprits, f.waiting) == ("all_reduce", 3, [2, 3], [0, 1])
    assert f.summary.startswith(f"process 1 (pid 1001, ranks [2, 3]) died during all_reduce at "
                                f"{SITE} (axis 'x', execution 3)"), f.summary
    assert f.summary.endswith("; it left no dump"), f.summary


def test_different_ops_at_one_call_are_a_mismatch(tmp_path):
    mismatch = "process 1 runs a different collective at this call (op, dtype or shape differ)"
    entries = done_calls([1])
    entries += [entry(p, 2, at=1.0, state="failed", error=mismatch) for p in (0, 1)]
    entries += [entry(p, 2, at=1.0, state="failed", error=mismatch, op="all_gather", nbytes=64)
                for p in (2, 3)]
    report = analyzer.analyze(write_dumps(tmp_path / "d", entries))
    f = top(report)
    assert (report.kind, f.execution, f.waiting, f.culprits) == ("mismatch", 2, [0, 1], [2, 3])
    assert f.summary == (f"program mismatch at {SITE} (axis 'x', execution 2): ranks [0, 1] run "
                         f"all_reduce of float32, 16 B per rank; ranks [2, 3] run all_gather of "
                         f"float32, 64 B per rank")


def test_ranks_waiting_in_different_calls_are_a_mismatch(tmp_path):
    # A cond that differs by rank: ranks 0, 1 wait in one collective, ranks 2, 3 in another,
    # each side for the other.
    entries = done_calls([1])
    entries += [entry(p, 1, at=1.0, state="failed", error=timed_out([2, 3]), op="all_gather",
                      instruction="00000000000000b2", call_site="train.py:20 (branch_a)")
                for p in (0, 1)]
    entries += [entry(p, 1, at=1.1, state="failed", error=timed_out([0, 1]), op="ppermute",
                      instruction="00000000000000c3", call_site="train.py:30 (branch_b)")
                for p in (2, 3)]
    report = analyzer.analyze(write_dumps(tmp_path / "d", entries))
    assert report.kind == "mismatch", report.text()
    assert [f.kind for f in report.findings] == ["mismatch"], report.text()
    f = top(report)
    assert (f.op, f.waiting, f.culprits) == ("all_gather", [0, 1], [2, 3])
    assert ("ranks [0, 1] (process 0) wait in all_gather at train.py:20 (branch_a)" in f.summary and
            "while ranks [2, 3] (process 1) wait in ppermute at train.py:30 (branch_b)" in f.summary), f.summary
    assert f.processes == [0, 1]


def _mismatch_error(here: int) -> str:
    """Process ``here``'s MISMATCH error: process 0 waits in all_reduce at SITE, process 1
    in all_gather at train.py:40 (eval), each for the other (ffi/core/mismatch.cc)."""
    sides = [f"process {p} (host host{p} (10.0.0.{p}), pid {PIDS[p]}) with ranks [{2 * p} {2 * p + 1}] "
             f"(partitions [{2 * p} {2 * p + 1}]) waits in {op} at {site} (execution #1"
             f"{', this call' if p == here else ''})"
             for p, op, site in [(0, "all_reduce", SITE), (1, "all_gather", "train.py:40 (eval)")]]
    if here == 1:
        sides.reverse()
    return ("MISMATCH: " + "; ".join(sides) + "; each side waits for the other, for longer than "
            "the grace period (3 s, JAXCOMM_MISMATCH_GRACE_S): the processes run different "
            "collectives at this step")


@pytest.mark.parametrize("other_dumped", [True, False], ids=["both-dumps", "one-dump"])
def test_mismatch_errors_name_both_sides(tmp_path, other_dumped):
    # Processes 0 and 1 waited in different collectives and failed with MISMATCH errors.
    # Without process 1's dump, its side is known from process 0's error alone.
    entries = done_calls([1])
    entries += [entry(p, 1, at=1.0, state="failed", error=_mismatch_error(0)) for p in (0, 1)]
    entries += [entry(p, 1, at=1.0, state="failed", error=_mismatch_error(1), op="all_gather",
                      instruction="00000000000000b2", call_site="train.py:40 (eval)")
                for p in (2, 3)]
    report = analyzer.analyze(write_dumps(tmp_path / "d", entries,
                                          processes=(0, 1) if other_dumped else (0,)))
    assert [f.kind for f in report.findings] == ["mismatch"], report.text()
    f = top(report)
    assert (f.waiting, f.culprits, f.processes) == ([0, 1], [2, 3], [0, 1]), report.text()
    assert report.verdict == (
        f"verdict: MISMATCH: program mismatch: ranks [0, 1] (process 0) wait in all_reduce at "
        f"{SITE} (axis 'x', execution 1) while ranks [2, 3] (process 1) wait in all_gather at "
        f"train.py:40 (eval) (axis 'x', execution 1): each side waits for the other (ranks take "
        f"different branches, or processes run different programs or dispatch them in "
        f"different orders)"), report.verdict


def test_calls_reached_after_a_mismatch_are_part_of_it(tmp_path):
    # Programs dispatched in opposite orders: each process waited in one call, then failed
    # the other (which its peer waited in) when it got there. Every rank has an entry in
    # both calls; the sides are who waited where, as the errors say: one finding.
    entries = done_calls([1])
    # (Either call's errors name both sides; which is "this call" does not matter here.)
    entries += [entry(p, 1, at=1.0, state="failed", error=_mismatch_error(0)) for p in GROUP]
    entries += [entry(p, 1, at=1.0, state="failed", error=_mismatch_error(1), op="all_gather",
                      instruction="00000000000000b2", call_site="train.py:40 (eval)")
                for p in GROUP]
    report = analyzer.analyze(write_dumps(tmp_path / "d", entries))
    assert [f.kind for f in report.findings] == ["mismatch"], report.text()
    f = top(report)
    assert "ranks [0, 1] (process 0) wait in all_reduce" in f.summary, f.summary
    assert "ranks [2, 3] (process 1) wait in all_gather" in f.summary, f.summary


def test_straggler(tmp_path):
    entries = done_calls(range(1, 4))
    entries[3 * 4 - 1]["enqueue_us"] += int(1.5 * S)  # rank 3, execution 3
    d = write_dumps(tmp_path / "d", entries)
    report = analyzer.analyze(d)
    assert (report.kind, report.exit_code) == ("straggler", 2), report.text()
    f = top(report)
    assert (f.execution, f.culprits, f.waiting) == (3, [3], [0, 1, 2])
    assert f.seconds == pytest.approx(1.5, abs=0.01)
    assert f.summary.startswith("rank 3 arrived 1.50 s after rank 0 at all_reduce"), f.summary
    assert analyzer.analyze(d, straggler_ms=2000).kind == "clean"


def test_fault_tolerant_calls_without_a_dead_process(tmp_path):
    # ft.all_reduce went on without process 1 (ranks 2 and 3) from execution 3 on.
    entries = done_calls(range(1, 3), op="ft.all_reduce")
    entries += [entry(p, e, at=1.0 + e, op="ft.all_reduce", left_out=[2, 3]) for e in (3, 4)
                for p in (0, 1)]
    report = analyzer.analyze(write_dumps(tmp_path / "d", entries, processes=[0]))
    assert (report.kind, report.exit_code) == ("dead", 1), report.text()
    f = top(report)
    assert (f.op, f.execution, f.culprits, f.waiting) == ("ft.all_reduce", 3, [2, 3], [0, 1])
    assert f.summary.startswith("ranks [2, 3] were left out of 2 fault-tolerant call(s) from "
                                f"ft.all_reduce at {SITE}"), f.summary
    assert f.summary.endswith("process(es) [1] left no dump (died or killed)"), f.summary


def test_failure_for_another_reason(tmp_path):
    error = "jaxcomm.all_reduce over axis 'x': mapping the shared memory of process 1 failed"
    entries = done_calls([1]) + [entry(p, 2, at=1.0, state="failed", error=error) for p in GROUP]
    f = top(analyzer.analyze(write_dumps(tmp_path / "d", entries)))
    assert (f.kind, f.execution, f.culprits) == ("failed", 2, [0, 1, 2, 3])
    assert f.summary.endswith(f"failed on ranks [0, 1, 2, 3]: {error}"), f.summary


def test_dumps_of_another_format_version_are_refused(tmp_path):
    d = write_dumps(tmp_path / "d", done_calls([1]))
    path = next(d.glob("*.json"))
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(dict(doc, version=2)))
    with pytest.raises(ValueError, match="dump format version 2 is not one of"):
        analyzer.analyze(d)


def test_two_recorders_of_one_process_are_both_read(tmp_path):
    # Under the CUDA emulation a process has two recorders (the host backend's and the
    # emulated CUDA calls', "recorder": "cuda-emu"), dumped side by side under one pid:
    # both are its records (before, the loader kept only the more complete one). Here the
    # host recorder holds a clean all_reduce; the emulated one a ppermute that rank 2
    # never reached at execution 2.
    host = write_dumps(tmp_path / "d", done_calls(range(1, 4)))
    emu = tmp_path / "emu"
    ppermute = dict(op="ppermute", instruction="00000000000000b2")
    late = timed_out([2]).replace("all_reduce", "ppermute")
    write_dumps(emu, done_calls([1], start=0.5, **ppermute) + [
        entry(p, 2, at=1.0, state="failed", error=late, **ppermute) for p in (0, 1, 3)])
    for path in emu.glob("*.json"):
        doc = json.loads(path.read_text())
        (host / path.name.replace(".json", "-cuda-emu.json")).write_text(json.dumps(dict(doc, recorder="cuda-emu")))
    dumps = analyzer.load(host)
    assert [(d["process_index"], d.get("recorder", "")) for d in dumps] == [
        (0, ""), (0, "cuda-emu"), (1, ""), (1, "cuda-emu")]
    report = analyzer.analyze(host)
    assert report.calls == 5, report.text()
    f = top(report)
    assert (f.kind, f.op, f.execution, f.culprits, f.waiting) == ("hang", "ppermute", 2, [2], [0, 1, 3])
    # Rank 2's last call, of both recorders: its ppermute of execution 1 (after the all_reduces).
    assert "rank 2: its last call was ppermute" in report.text(), report.text()


def test_ring_file_names_their_recorder():
    assert ringfile.recorder_tag("/t/jaxcomm-ring-p3-4711.bin") == ""
    assert ringfile.recorder_tag("/t/jaxcomm-ring-p3-4711-cuda-emu.bin") == "cuda-emu"


# ---------------------------------------------------------------------------------- CLI

def test_cli_prints_the_verdict_first_and_exits_with_its_status(tmp_path, capsys):
    entries = done_calls([1, 2]) + [entry(p, 3, at=1.0, state="failed", error=timed_out([2]))
                                    for p in (0, 1, 3)]
    d = write_dumps(tmp_path / "d", entries)
    assert trace_cli.main(["analyze", str(d)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"verdict: HANG: ranks [2] never arrived at all_reduce at {SITE} (axis 'x', "
                     f"execution 3); ranks [0, 1, 3] waited for them and timed out")
    assert trace_cli.main(["analyze", str(d), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["kind"], doc["exit_code"]) == ("hang", 1)
    assert doc["findings"][0]["culprits"] == [2] and doc["findings"][0]["waiting"] == [0, 1, 3]
    clean = write_dumps(tmp_path / "clean", done_calls([1, 2]))
    assert trace_cli.main(["analyze", str(clean)]) == 0
    assert capsys.readouterr().out.startswith("verdict: clean: 2 calls on 4 ranks")
