"""Merges the flight recorder dumps of a job and says what went wrong, and where.

A collective call is identified across ranks and processes by (instruction, group,
execution): the instruction key is the same in every process, and the execution count
numbers that instruction's rounds for that group. For each call the analyzer knows who
arrived (has an entry), who did not (group members without one), and how it ended.

Findings, most serious first:

* ``mismatch``: ranks stuck in different collectives at the same time, each waiting for
  the others (a ``lax.cond`` that differs by rank, processes running different programs
  or dispatching them in different orders: jaxcomm fails these within its grace period
  with a ``MISMATCH:`` error naming both sides), or ranks that ran different ops/sizes
  at the same call. The finding names both call sites and the ranks (and processes)
  on each side, from the dumps or, when one side left none, from the errors.
* ``dead``: a process died during a call (its peers saw it exit or its connection
  close).
* ``hang``: ranks that never arrived at a call their peers waited in (and timed out in,
  or still wait in at dump time).
* ``failed``: calls that failed for another reason (the error text is shown).
* ``straggler``: completed calls whose ranks arrived far apart (arrival skew at least
  ``straggler_ms``): the late rank and by how much.

Across processes, failures are ordered by cause (:mod:`jaxcomm.trace.causes`): a process
whose own error named another process before anyone named it failed because of that
process (it timed out waiting for it, then exited, and the others saw it exit). A
finding names the processes at the root of such chains; the others are listed under it
as its consequences. So the verdict names the process that hung, died or ran late, not
the first one to give up on it.

Every process's records are read: its JSON dumps and, under ``JAXCOMM_TRACE_DIR``, its
file-backed rings (:mod:`jaxcomm.trace.ringfile`), which outlive a process killed by a
signal or aborted by JAX; for each process the more complete of the two counts.

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

from jaxcomm.trace import causes, ringfile

#: Dump format versions this analyzer reads.
VERSIONS = (1,)

_SEVERITY = {"mismatch": 0, "dead": 1, "hang": 2, "failed": 3, "straggler": 4}
_UNFINISHED = ("pending", "active")
_SAME_CALL_MISMATCH = re.compile(r"runs a different collective")
_MISMATCH = re.compile(r"^MISMATCH:")
# What a dead process's peers said of it: "failed: it exited before it arrived ...".
_WHY_DEAD = re.compile(r"failed: (.*?)(?: after it arrived| before it arrived|;|$)")
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
      processes: the processes at fault (across processes; empty within one).
      consequences: what followed from it on other processes (lines), e.g. a process
        that gave up waiting and exited, and what its peers then reported.
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
    processes: list[int] = dataclasses.field(default_factory=list)
    consequences: list[str] = dataclasses.field(default_factory=list)


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


def load(directory: str | os.PathLike[str],
         pids: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """Each process's records in ``directory``: the most complete of its JSON dumps and
    its ring file (most calls recorded; then the latest; then the JSON, whose error texts
    are never cut), per recorder of the process (a process under the CUDA emulation has
    two: the host backend's and the emulated CUDA backend's, ``"recorder": "cuda-emu"``).
    ``pids``: only the records of these processes (one job's, in a directory that holds
    several)."""
    wanted = None if pids is None else set(pids)
    found: dict[tuple[int, int], dict[str, Any]] = {}
    paths = sorted(glob.glob(os.path.join(os.fspath(directory), "*.json")))
    rings = sorted(glob.glob(os.path.join(os.fspath(directory), "jaxcomm-ring-p*.bin")))
    for path in paths + rings:
        try:
            if ringfile.is_ring_file(path):
                d = ringfile.read(path)
            else:
                with open(path) as f:
                    d = json.load(f)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            if isinstance(e, ValueError) and "version" in str(e):
                raise
            continue
        if not isinstance(d, dict) or d.get("format") != "jaxcomm-trace":
            continue
        if d.get("version") not in VERSIONS:
            raise ValueError(f"{path}: dump format version {d.get('version')} is not one of "
                             f"{VERSIONS}; use the jaxcomm that wrote it")
        d["path"] = path
        if wanted is not None and d["pid"] not in wanted:
            continue
        key = (d["process_index"], d["pid"], d.get("recorder", ""))
        if key not in found or _completeness(d) > _completeness(found[key]):
            found[key] = d
    return sorted(found.values(), key=lambda d: (d["process_index"], d["pid"], d.get("recorder", "")))


def _completeness(d: dict[str, Any]) -> tuple[int, int, int]:
    calls = sum(r["calls"] for r in d.get("ranks", []))
    return calls, d["dumped_at_us"], d.get("reason") != "ring file"


def merge(dumps: Iterable[dict[str, Any]]) -> tuple[dict[tuple[str, int, int], Call], dict[int, list]]:
    """Calls by (instruction, group index, execution), and each rank's entries in order."""
    calls: dict[tuple[str, int, int], Call] = {}
    by_rank: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for d in dumps:
        for e in d["entries"]:
            e = dict(e, process=d["process_index"], pid=d["pid"], host=d["host"],
                     dumped_at_us=d["dumped_at_us"], recorder=d.get("recorder", ""))
            by_rank[e["partition"]].append(e)
            key = (e["instruction"], e["group_index"], e["execution"])
            c = calls.get(key)
            if c is None:
                c = calls[key] = Call(key, e["op"], e["call_site"], e["axis"], tuple(e["group"]), {})
            c.entries[e["partition"]] = e
    for entries in by_rank.values():
        # A rank's calls in the order it made them: each recorder numbers its own.
        if len({e["recorder"] for e in entries}) > 1:
            entries.sort(key=lambda e: (e["enqueue_us"], e["recorder"], e["seq"]))
        else:
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
        return "no records from it"
    e = max(entries, key=lambda e: e["enqueue_us"])
    return (f"its last call was {e['op']} at {e['call_site']} (execution {e['execution']}), "
            f"{e['state']}")


def _process_finding(c: Call, waiting: list[int], errors: list[str], base: dict[str, Any],
                     process_of: dict[int, int], secondary: dict[int, tuple[float, list[int]]],
                     recorded: set[int], by_rank: dict[int, list]) -> Finding | None:
    """The finding of a stuck call whose fault lies in other processes, or None (the
    ranks it waited for live in the waiting processes: a fault within one process)."""
    reporters = {c.entries[r]["process"] for r in waiting}
    said: dict[int, causes.Blame] = {}      # first thing said of each process
    dead: dict[int, causes.Blame] = {}
    told_by: dict[int, set[int]] = collections.defaultdict(set)
    for e in c.entries.values():
        for b in causes.blames(e.get("error")):
            if b.kind == "mismatch":
                continue
            said.setdefault(b.process, b)
            told_by[b.process].add(e["process"])
            if b.kind == "dead":
                dead.setdefault(b.process, b)
    absent: dict[int, list[int]] = collections.defaultdict(list)  # its ranks missing here
    for r in c.missing:
        if r in process_of:
            absent[process_of[r]].append(r)
    candidates = set(said) | set(absent)
    # A waiting process is at fault only for its own ranks that never came (the rest of
    # it waits like everyone else); one whose ranks all came is waiting, not at fault.
    candidates = {p for p in candidates if p not in reporters or absent.get(p)}
    if not candidates or candidates <= reporters and not (set(said) - reporters):
        return None
    roots = sorted({q for p in candidates for q in causes.root_of(p, secondary)})
    ranks_of = collections.defaultdict(set)
    for r, p in process_of.items():
        ranks_of[p].add(r)

    def culprit_ranks(p: int) -> list[int]:
        if p in reporters:
            return sorted(absent.get(p, []))
        if p in said:
            return sorted(said[p].partitions)
        return sorted(absent.get(p) or ranks_of.get(p) or [])

    culprits = sorted({r for p in roots for r in culprit_ranks(p)})
    timed_out = any("timed out" in x for x in errors)
    dead_roots = [p for p in roots if p in dead]
    details = []
    if dead_roots:
        kind = "dead"
        parts = []
        for p in dead_roots:
            b = dead[p]
            when = {True: " after it arrived", False: " before it arrived"}.get(b.arrived, "")
            parts.append(f"process {p} (pid {b.pid}, ranks {_ranks(b.partitions)}) died during "
                         f"{c.where()}{when}: {b.said or 'it exited'}"
                         + ("" if p in recorded else "; it left no dump"))
        summary = "; ".join(parts)
    else:
        kind = "hang"
        named = " and ".join(f"process {p}" for p in roots)
        if len(roots) == 1 and roots[0] in reporters:
            named = f"ranks {_ranks(culprits)} (process {roots[0]})"
        elif len(roots) == 1:
            named += f" (ranks {_ranks(culprits)})"
        else:
            named = f"processes {_ranks(roots)} (ranks {_ranks(culprits)})"
        arrived_late = [p for p in roots if p not in absent and p not in said]
        summary = (f"{named} never arrived at {c.where()}; ranks {_ranks(waiting)} waited for "
                   f"{'them' if len(culprits) > 1 else 'it'}" + (" and timed out" if timed_out else ""))
        if arrived_late:
            summary += f" (the errors here lead back to process(es) {_ranks(arrived_late)})"
        for p in roots:
            if p in recorded:
                for r in culprit_ranks(p):
                    details.append(f"rank {r}: {_last_seen(by_rank.get(r, []))}")
            else:
                details.append(f"process {p} left no dump")
    consequences = []
    for p in sorted((set(said) | candidates) - set(roots)):
        first = secondary.get(p)
        mine = said[p].partitions if p in said else ranks_of.get(p, ())
        what = f"process {p} (ranks {_ranks(mine)})" + (
            f" failed first, with an error naming process(es) {_ranks(first[1])}" if first else "")
        if p in dead:
            what += (f", then {dead[p].said or 'it exited'}; process(es) "
                     f"{_ranks(told_by[p] - {p})} reported that")
        consequences.append(what)
    return Finding(kind, summary, culprits=culprits, processes=roots,
                   consequences=consequences, **base, details=details + errors[:3])


def _cross_call_mismatch(c: Call, waiting: list[int], errors: list[str], base: dict[str, Any],
                         stuck: list[Call], stuck_in: dict[int, Call], stuck_s: float,
                         process_of: dict[int, int],
                         explained: set[tuple[str, int, int]]) -> Finding | None:
    """The finding of ranks that wait in ``c`` while other ranks of its group wait in
    other calls, each side for the other: the ranks ``c`` misses are stuck elsewhere (the
    dumps say so), or ``c`` failed with ``MISMATCH:`` errors that name the other sides
    (their calls are found in the dumps, or known from the errors alone when their
    processes left none). None when neither."""
    def stuck_ranks(o: Call) -> list[int]:
        return sorted(r for r, e in o.entries.items() if _is_stuck(e, stuck_s))

    def leads_back(o: Call) -> bool:
        """Whether the ranks ``o`` misses wait, in turn, for ``c``'s ranks: a cycle of
        waits (as core/mismatch.cc's FindCycle). Else ``c`` is a link of a chain that ends
        at a rank that hung or died, and no mismatch."""
        seen, todo = {o.key}, [o]
        while todo:
            for r in todo.pop().missing:
                nxt = stuck_in.get(r)
                if nxt is None or nxt.key in seen:
                    continue
                if nxt.key == c.key:
                    return True
                seen.add(nxt.key)
                todo.append(nxt)
        return False

    def call_at(op: str, call_site: str, execution: int) -> Call | None:
        return next((o for o in stuck if (o.op, o.call_site, o.key[2]) == (op, call_site, execution)
                     and o.group == c.group), None)

    # Across processes, the errors say who waited where (each names every side, its own
    # included): a process that only reached a call after the mismatch failed there too,
    # but did not wait in it.
    told: dict[Any, tuple[list[int], str]] = {}
    for x in errors:
        if not _MISMATCH.search(x):
            continue
        for b in causes.blames(x):
            if b.kind != "mismatch" or not b.op:
                continue
            o = call_at(b.op, b.call_site, b.execution)
            key = o.key if o is not None else (b.op, b.call_site, b.execution)
            where = o.where() if o is not None else (
                f"{b.op} at {b.call_site} (axis {c.axis}, execution {b.execution})")
            ranks, _ = told.setdefault(key, ([], where))
            ranks.extend(r for r in b.partitions if r not in ranks)
    sides: dict[Any, tuple[list[int], str]] = {}
    if len(told) > 1:
        sides = {k: (sorted(rs), where) for k, (rs, where) in told.items()}
    else:
        # Within a process, the dumps: the ranks this call misses wait in other calls,
        # which wait for this call's ranks.
        sides[c.key] = (sorted(waiting), c.where())
        for r in c.missing:
            o = stuck_in.get(r)
            if o is not None and o.key != c.key and leads_back(o):
                sides.setdefault(o.key, (stuck_ranks(o), o.where()))
    sides = {k: v for k, v in sides.items() if v[0]}
    if len(sides) < 2:
        return None
    for k in sides:
        if isinstance(k, tuple):
            explained.add(k)
    mine = sides.get(c.key, ([], ""))[0]
    culprits = sorted({r for k, (rs, _) in sides.items() if k != c.key for r in rs} - set(mine))
    several = len(set(process_of.values())) > 1

    def who(ranks: list[int]) -> str:
        procs = sorted({process_of[r] for r in ranks if r in process_of})
        return f"ranks {_ranks(ranks)}" + (
            f" (process{'es' if len(procs) > 1 else ''} {', '.join(map(str, procs))})"
            if several and procs else "")

    processes = sorted({process_of[r] for rs, _ in sides.values() for r in rs if r in process_of})
    return Finding(
        "mismatch", "program mismatch: " + " while ".join(f"{who(rs)} wait in {where}"
                                                         for rs, where in sides.values()) +
        ": each side waits for the other (ranks take different branches, or processes run "
        "different programs or dispatch them in different orders)",
        culprits=culprits, **base, details=errors[:3], processes=processes if several else [])


def analyze(directory: str | os.PathLike[str], *, straggler_ms: float = 250.0,
            stuck_s: float = 5.0, pids: Iterable[int] | None = None) -> Report:
    """Analyzes the dumps in ``directory``.

    Args:
      straggler_ms: the arrival skew at which a completed call counts as a straggler.
      stuck_s: how long a call still pending at dump time must have waited to count as
        stuck (failed calls always count).
      pids: only the records of these processes (one job's; default: all).

    Example::

        report = jaxcomm.trace.analyze("/tmp/traces")
        print(report.verdict)
        assert report.exit_code == 0
    """
    dumps = load(directory, pids)
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

    # Which process each rank lives in, and which processes' failures were consequences.
    process_of: dict[int, int] = {}
    failures: list[causes.Failure] = []
    for c in calls.values():
        for r, e in c.entries.items():
            process_of[r] = e["process"]
            said = causes.blames(e.get("error"))
            for b in said:
                for part in b.partitions:
                    process_of.setdefault(part, b.process)
            if said:
                failures.append(causes.Failure(e["process"], e["end_us"] or e["enqueue_us"], said))
    secondary = causes.consequences(failures)

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
        if len(shapes) > 1 or any(_SAME_CALL_MISMATCH.search(x) for x in errors):
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
        finding = _cross_call_mismatch(c, waiting, errors, base, stuck, stuck_in, stuck_s,
                                       process_of, explained)
        if finding is not None:
            findings.append(finding)
            explained.add(c.key)
            continue
        # Processes that died, never arrived or ran late, as the errors of this call and
        # the ranks missing from it say; the ones whose failure followed from another's
        # (they gave up on it first) are its consequences.
        finding = _process_finding(c, waiting, errors, base, process_of, secondary,
                                   set(processes), by_rank)
        if finding is not None:
            findings.append(finding)
            explained.add(c.key)
            continue
        # Ranks that came after their peers had already given up (a straggler slower than
        # the deadline): they are the cause, not the ranks that timed out.
        late = sorted(r for r, e in c.entries.items() if e.get("error") and _LATE in e["error"])
        if not late:
            # Ranks of other processes are not told they came too late (their own process
            # did not see the others give up: the CUDA IPC and NCCL routes fail them later,
            # naming the peer that gave up): the ones that arrived after a peer had timed
            # out are.
            gave_up = [e["end_us"] for e in c.entries.values()
                       if e.get("error") and "timed out" in e["error"] and e.get("end_us")]
            after = sorted(r for r, e in c.entries.items() if gave_up and e["enqueue_us"] > min(gave_up))
            late = after if len(after) < len(c.entries) else []
        if late and not c.missing:
            on_time = [r for r in c.entries if r not in late]
            first = min(c.entries[r]["enqueue_us"] for r in on_time) if on_time else start
            by = max(c.entries[r]["enqueue_us"] for r in late) - first
            # Across processes, the late processes first (as the other findings name them).
            late_processes = sorted({c.entries[r]["process"] for r in late})
            spans = len({e["process"] for e in c.entries.values()}) > 1
            named = (f"process{'es' if len(late_processes) > 1 else ''} "
                     f"{', '.join(map(str, late_processes))} (ranks {_ranks(late)})" if spans
                     else f"ranks {_ranks(late)}")
            findings.append(Finding(
                "hang", f"{named} arrived at {c.where()} {by / 1e6:.2f} s after "
                f"the first rank, after ranks {_ranks(on_time)} had timed out waiting for them",
                culprits=late, **dict(base, waiting=sorted(on_time)), details=errors[:3],
                processes=late_processes if spans else []))
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

    # One fault seen from several calls (a dead process is named in each call it missed):
    # once, from the first call.
    seen_faults: set[tuple[str, tuple[int, ...]]] = set()
    unique = []
    for f in sorted(findings, key=lambda f: f.seconds):
        key = (f.kind, tuple(f.processes))
        # (A mismatch's calls are one finding already; two mismatches are two.)
        if f.processes and f.kind != "mismatch" and key in seen_faults:
            continue
        seen_faults.add(key)
        unique.append(f)
    findings = unique

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
        owners = sorted({process_of[r] for r in left if r in process_of})
        who = (f"process{'es' if len(owners) > 1 else ''} "
               f"{', '.join(map(str, owners))} (ranks {_ranks(list(left))})" if owners
               else f"ranks {_ranks(list(left))}")
        findings.append(Finding(
            "dead", f"{who} {'were' if len(left) > 1 else 'was'} left out of {len(cs)} "
            f"fault-tolerant call(s) from {first.where()} on; the others went on without "
            f"{'them' if len(left) > 1 else 'it'}" +
            (f"; process(es) {_ranks(gone)} left no dump (died or killed)" if gone else ""),
            op=first.op, call_site=first.call_site, axis=first.axis, execution=first.key[2],
            culprits=list(left), waiting=first.arrived, seconds=start / 1e6, processes=owners,
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
        lines.extend(f"    consequence: {d}" for d in f.consequences)
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
