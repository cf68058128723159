"""Merges the flight recorder dumps of a job and says what went wrong, and where.

A collective call is identified across ranks and processes by (instruction, group,
execution): the instruction key is the same in every process, and the execution count
numbers that instruction's rounds for that group. For each call the analyzer knows who
arrived (has an entry), who did not (group members without one), and how it ended.

Findings, most serious first:

* ``mismatch``: ranks stuck in different collectives at the same time, each waiting for
  the others (a ``lax.cond`` that differs by rank, or processes running different
  programs), or ranks that ran different ops/sizes at the same call.
* ``dead``: a process died during a call (its peers saw it exit or its connection
  close); it left no dump.
* ``hang``: ranks that never arrived at a call their peers waited in (and timed out in,
  or still wait in at dump time).
* ``failed``: calls that failed for another reason (the error text is shown).
* ``straggler``: completed calls whose ranks arrived far apart (arrival skew at least
  ``straggler_ms``): the late rank and by how much.

The first line printed is one verdict; the exit status of ``python -m jaxcomm.trace
analyze`` is 0 for a clean run, 1 for a fault, 2 when the only finding is stragglers.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import statistics
from typing import Any, Iterable

#: Dump format versions this analyzer reads.
VERSIONS = (1,)

_SEVERITY = {"mismatch": 0, "dead": 1, "hang": 2, "failed": 3, "straggler": 4}
_UNFINISHED = ("pending", "active")
# "process 1 (host h, pid 12) with ranks [2 3] (partitions [2 3]) failed: it exited ..."
_DEAD_RE = re.compile(r"process (\d+) \(host [^,]*, pid (\d+)\) with ranks \[[^\]]*\] "
                      r"\(partitions \[([^\]]*)\]\) failed: ([^;]*?)(?: after| before|$)")
_MISMATCH_RE = re.compile(r"runs a different collective")
_LATE = "arrived too late"  # rendezvous.cc: a rank that came after its peers timed out


@dataclasses.dataclass
class Finding:
    """One problem, with the ranks (partition ids) it names.

    Attributes:
      kind: ``mismatch``, ``dead``, ``hang``, ``failed`` or ``straggler``.
      summary: one line, as printed.
      op, call_site, axis, execution: the call (for mismatch: the first side's).
      culprits: the ranks at fault (never arrived, died, late, or the other side of a
        mismatch).
      waiting: the ranks that waited for them.
      details: further lines.
    """

    kind: str
    summary: str
    op: str = ""
    call_site: str = ""
    axis: str = ""
    execution: int = 0
    culprits: list[int] = dataclasses.field(default_factory=list)
    waiting: list[int] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0  # straggler: how late; others: when it started (sort key)


@dataclasses.dataclass
class Report:
    """The analyzer's result: ``verdict`` (one line), ``kind`` of the verdict (``clean``,
    ``empty`` or a finding kind), all ``findings`` and summary numbers."""

    verdict: str
    kind: str
    findings: list[Finding]
    processes: list[int]
    ranks: list[int]
    calls: int
    skew_ms: list[float]
    lines: list[str]

    @property
    def exit_code(self) -> int:
        if self.kind in ("clean", "empty"):
            return 0
        return 2 if self.kind == "straggler" else 1

    def text(self) -> str:
        return "\n".join([self.verdict] + self.lines)


@dataclasses.dataclass
class Call:
    """One collective call across ranks: the entries of the ranks that arrived."""

    key: tuple[str, int, int]
    op: str
    call_site: str
    axis: str
    group: tuple[int, ...]
    entries: dict[int, dict[str, Any]]

    @property
    def arrived(self) -> list[int]:
        return sorted(self.entries)

    @property
    def missing(self) -> list[int]:
        return sorted(set(self.group) - set(self.entries))

    def where(self) -> str:
        return f"{self.op} at {self.call_site} (axis {self.axis}, execution {self.key[2]})"


def load(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The flight recorder dumps (parsed JSON) in ``directory``, newest per process."""
    dumps: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(directory), "*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict) or d.get("format") != "jaxcomm-trace":
            continue
        if d.get("version") not in VERSIONS:
            raise ValueError(f"{path}: dump format version {d.get('version')} is not one of "
                             f"{VERSIONS}; use the jaxcomm that wrote it")
        d["path"] = path
        key = (d["process_index"], d["pid"])
        if key not in dumps or d["dumped_at_us"] > dumps[key]["dumped_at_us"]:
            dumps[key] = d
    return sorted(dumps.values(), key=lambda d: (d["process_index"], d["pid"]))


def merge(dumps: Iterable[dict[str, Any]]) -> tuple[dict[tuple[str, int, int], Call], dict[int, list]]:
    """Calls by (instruction, group index, execution), and each rank's entries in order."""
    calls: dict[tuple[str, int, int], Call] = {}
    by_rank: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for d in dumps:
        for e in d["entries"]:
            e = dict(e, process=d["process_index"], pid=d["pid"], host=d["host"],
                     dumped_at_us=d["dumped_at_us"])
            by_rank[e["partition"]].append(e)
            key = (e["instruction"], e["group_index"], e["execution"])
            c = calls.get(key)
            if c is None:
                c = calls[key] = Call(key, e["op"], e["call_site"], e["axis"], tuple(e["group"]), {})
            c.entries[e["partition"]] = e
    for entries in by_rank.values():
        entries.sort(key=lambda e: e["seq"])
    return calls, by_rank


def _ranks(rs: Iterable[int]) -> str:
    return "[" + ", ".join(str(r) for r in sorted(rs)) + "]"


def _is_stuck(e: dict[str, Any], stuck_s: float) -> bool:
    if e["state"] == "failed":
        return True
    return e["state"] in _UNFINISHED and (e["dumped_at_us"] - e["enqueue_us"]) >= stuck_s * 1e6


def _last_seen(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no entries from it in any dump"
    e = max(entries, key=lambda e: e["enqueue_us"])
    return (f"its last call was {e['op']} at {e['call_site']} (execution {e['execution']}), "
            f"{e['state']}")


def analyze(directory: str | os.PathLike[str], *, straggler_ms: float = 250.0,
            stuck_s: float = 5.0) -> Report:
    """Analyzes the dumps in ``directory``.

    Args:
      straggler_ms: the arrival skew at which a completed call counts as a straggler.
      stuck_s: how long a call still pending at dump time must have waited to count as
        stuck (failed calls always count).

    Example::

        report = jaxcomm.trace.analyze("/tmp/traces")
        print(report.verdict)
        assert report.exit_code == 0
    """
    dumps = load(directory)
    if not dumps:
        return Report(f"verdict: empty: no jaxcomm flight recorder dumps in {directory}", "empty",
                      [], [], [], 0, [], [])
    calls, by_rank = merge(dumps)
    processes = sorted({d["process_index"] for d in dumps})
    expected = sorted({p for c in calls.values() for e in c.entries.values() for p in e["processes"]})
    ranks = sorted(by_rank)
    findings: list[Finding] = []

    # Stuck calls: some rank failed there, or still waits there long after it arrived.
    stuck = [c for c in calls.values() if c.key[2] > 0 and
             any(_is_stuck(e, stuck_s) for e in c.entries.values())]
    stuck.sort(key=lambda c: min(e["enqueue_us"] for e in c.entries.values()))
    # Which stuck call each rank is in (its earliest one).
    stuck_in: dict[int, Call] = {}
    for c in stuck:
        for r, e in c.entries.items():
            if _is_stuck(e, stuck_s):
                stuck_in.setdefault(r, c)

    explained: set[tuple[str, int, int]] = set()
    for c in stuck:
        if c.key in explained:
            continue
        waiting = [r for r, e in c.entries.items() if _is_stuck(e, stuck_s)]
        errors = sorted({e["error"] for e in c.entries.values() if e.get("error")})
        start = min(e["enqueue_us"] for e in c.entries.values())
        base = dict(op=c.op, call_site=c.call_site, axis=c.axis, execution=c.key[2],
                    waiting=sorted(waiting), seconds=start / 1e6)
        # Different ops or sizes at one call.
        shapes: dict[tuple[str, str, int], list[int]] = collections.defaultdict(list)
        for r, e in sorted(c.entries.items()):
            shapes[(e["op"], e["dtype"], e["bytes"])].append(r)
        if len(shapes) > 1 or any(_MISMATCH_RE.search(x) for x in errors):
            sides = sorted(shapes.items(), key=lambda kv: kv[1])
            parts = [f"ranks {_ranks(rs)} run {op} of {dtype}, {b} B per rank"
                     for (op, dtype, b), rs in sides]
            others = [r for _, rs in sides[1:] for r in rs] + c.missing
            findings.append(Finding(
                "mismatch", f"program mismatch at {c.call_site} (axis {c.axis}, execution "
                f"{c.key[2]}): " + "; ".join(parts),
                culprits=sorted(others), **dict(base, waiting=sides[0][1]), details=errors[:3]))
            explained.add(c.key)
            continue
        # The missing ranks are stuck in other collectives: they wait for each other.
        others = {stuck_in[r].key: stuck_in[r] for r in c.missing
                  if r in stuck_in and stuck_in[r].key != c.key}
        if others:
            sides = [f"ranks {_ranks(waiting)} wait in {c.where()}"]
            for o in others.values():
                o_wait = [r for r, e in o.entries.items() if _is_stuck(e, stuck_s)]
                sides.append(f"ranks {_ranks(o_wait)} wait in {o.where()}")
                explained.add(o.key)
            culprits = sorted(r for r in c.missing if r in stuck_in)
            findings.append(Finding(
                "mismatch", "program mismatch: " + " while ".join(sides) +
                ": each side waits for the other (ranks take different branches or run "
                "different programs)", culprits=culprits, **base, details=errors[:3]))
            explained.add(c.key)
            continue
        # A peer process died.
        dead = {}
        for x in errors:
            for m in _DEAD_RE.finditer(x):
                if "exited" in m.group(4) or "closed" in m.group(4) or "reset" in m.group(4):
                    parts = [int(p) for p in m.group(3).split()]
                    dead[int(m.group(1))] = (int(m.group(2)), parts, m.group(4).strip())
        if dead:
            for proc, (pid, parts, why) in sorted(dead.items()):
                nodump = proc not in processes
                findings.append(Finding(
                    "dead", f"process {proc} (pid {pid}, ranks {_ranks(parts)}) died during "
                    f"{c.where()}: {why}" + ("; it left no dump" if nodump else ""),
                    culprits=parts, **base, details=errors[:3]))
            explained.add(c.key)
            continue
        # Ranks that came after their peers had already given up (a straggler slower than
        # the deadline): they are the cause, not the ranks that timed out.
        late = sorted(r for r, e in c.entries.items() if e.get("error") and _LATE in e["error"])
        if late and not c.missing:
            on_time = [r for r in c.entries if r not in late]
            first = min(c.entries[r]["enqueue_us"] for r in on_time) if on_time else start
            by = max(c.entries[r]["enqueue_us"] for r in late) - first
            findings.append(Finding(
                "hang", f"ranks {_ranks(late)} arrived at {c.where()} {by / 1e6:.2f} s after "
                f"the first rank, after ranks {_ranks(on_time)} had timed out waiting for them",
                culprits=late, **dict(base, waiting=sorted(on_time)), details=errors[:3]))
            explained.add(c.key)
            continue
        missing = c.missing
        if missing:
            lines = []
            for r in missing:
                lines.append(f"rank {r}: {_last_seen(by_rank.get(r, []))}")
            gone = sorted(set(expected) - set(processes))
            if gone:
                lines.append(f"no dump from process(es) {_ranks(gone)}")
            findings.append(Finding(
                "hang", f"ranks {_ranks(missing)} never arrived at {c.where()}; ranks "
                f"{_ranks(waiting)} waited for them" +
                (" and timed out" if any("timed out" in x for x in errors) else ""),
                culprits=missing, **base, details=lines + errors[:3]))
            explained.add(c.key)
            continue
        findings.append(Finding(
            "failed", f"{c.where()} failed on ranks {_ranks(waiting)}: "
            f"{errors[0] if errors else 'still in progress at dump time'}",
            culprits=sorted(waiting), **base, details=errors[1:3]))
        explained.add(c.key)

    # Fault-tolerant calls that went on without some ranks (their process died or was
    # late): name those ranks once, from the first call that left them out.
    gone = sorted(set(expected) - set(processes))
    without: dict[tuple[int, ...], list[Call]] = collections.defaultdict(list)
    for c in calls.values():
        left = sorted({c.group[r] for e in c.entries.values() for r in e.get("left_out", [])
                       if r < len(c.group)})
        if left and c.key not in explained:
            without[tuple(left)].append(c)
    for left, cs in without.items():
        cs.sort(key=lambda c: min(e["enqueue_us"] for e in c.entries.values()))
        first = cs[0]
        start = min(e["enqueue_us"] for e in first.entries.values())
        findings.append(Finding(
            "dead", f"ranks {_ranks(list(left))} were left out of {len(cs)} fault-tolerant "
            f"call(s) from {first.where()} on; the others went on without them" +
            (f"; process(es) {_ranks(gone)} left no dump (died or killed)" if gone else ""),
            op=first.op, call_site=first.call_site, axis=first.axis, execution=first.key[2],
            culprits=list(left), waiting=first.arrived, seconds=start / 1e6,
            details=[f"rank {r}: {_last_seen(by_rank.get(r, []))}" for r in left]))

    # Arrival skew of completed calls whose every rank is in the dumps.
    skews: list[tuple[float, Call, int]] = []
    for c in calls.values():
        if c.key[2] <= 0 or c.missing or len(c.entries) < 2:
            continue
        if any(e["state"] != "done" for e in c.entries.values()):
            continue
        arrivals = {r: e["enqueue_us"] for r, e in c.entries.items()}
        late = max(arrivals, key=arrivals.get)
        skews.append(((arrivals[late] - min(arrivals.values())) / 1e3, c, late))
    skew_ms = sorted(s for s, _, _ in skews)
    late_count = collections.Counter(late for s, _, late in skews if s >= straggler_ms)
    for s, c, late in sorted(skews, key=lambda t: -t[0]):
        if s < straggler_ms:
            break
        first = min(c.entries, key=lambda r: c.entries[r]["enqueue_us"])
        findings.append(Finding(
            "straggler", f"rank {late} arrived {s / 1e3:.2f} s after rank {first} at "
            f"{c.where()}", op=c.op, call_site=c.call_site, axis=c.axis, execution=c.key[2],
            culprits=[late], waiting=sorted(r for r in c.entries if r != late), seconds=s / 1e3,
            details=[f"rank {late} was the late one in {late_count[late]} of the calls with "
                     f"skew >= {straggler_ms:g} ms"]))
        if sum(f.kind == "straggler" for f in findings) >= 20:
            break

    findings.sort(key=lambda f: (_SEVERITY[f.kind], -f.seconds if f.kind == "straggler" else f.seconds))
    lines = [f"dumps: {len(dumps)} from processes {_ranks(processes)}"
             + (f" (expected {_ranks(expected)})" if set(expected) - set(processes) else "")
             + f"; {len(ranks)} ranks, {len(calls)} calls"]
    if skew_ms:
        p50 = statistics.median(skew_ms)
        p99 = skew_ms[min(len(skew_ms) - 1, int(0.99 * len(skew_ms)))]
        lines.append(f"arrival skew over {len(skew_ms)} completed calls: median {p50:.2f} ms, "
                     f"p99 {p99:.2f} ms, max {skew_ms[-1]:.2f} ms")
    for f in findings:
        lines.append(f"- {f.kind}: {f.summary}")
        lines.extend(f"    {d}" for d in f.details)
    if findings:
        top = findings[0]
        verdict = f"verdict: {top.kind.upper()}: {top.summary}"
        kind = top.kind
    else:
        verdict = (f"verdict: clean: {len(calls)} calls on {len(ranks)} ranks in "
                   f"{len(processes)} process(es) completed; no stuck, missing, mismatched "
                   f"or late ranks" + (f" (max arrival skew {skew_ms[-1]:.2f} ms)" if skew_ms else ""))
        kind = "clean"
    return Report(verdict, kind, findings, processes, ranks, len(calls), skew_ms, lines)
