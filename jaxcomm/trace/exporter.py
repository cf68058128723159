"""Timelines of the flight recorder dumps: Perfetto (Chrome trace JSON) and a PNG plot."""

from __future__ import annotations

import json
import os
import re
import textwrap
from typing import Any

from jaxcomm._src.stats import bus_factor, message_bytes
from jaxcomm.trace import analyzer


def perfetto(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Writes the dumps in ``directory`` as a Chrome trace (open in ui.perfetto.dev or
    chrome://tracing) to ``out`` and returns it.

    One track per rank: process = the jaxcomm process (its index), thread = the rank
    (partition id). Each call is a slice from its arrival (enqueue) to its end, with a
    nested ``wait`` slice until its data movement started; calls still pending at dump
    time end at the dump time and are marked ``(stuck)``.
    """
    dumps = analyzer.load(directory)
    events: list[dict[str, Any]] = []
    t0 = min((e["enqueue_us"] for d in dumps for e in d["entries"]), default=0)
    for d in dumps:
        pid = d["process_index"]
        events.append(dict(ph="M", name="process_name", pid=pid, tid=0,
                           args=dict(name=f"jaxcomm process {pid} (pid {d['pid']}, {d['host']})")))
        for r in d["ranks"]:
            events.append(dict(ph="M", name="thread_name", pid=pid, tid=r["partition"],
                               args=dict(name=f"rank {r['partition']}")))
            events.append(dict(ph="M", name="thread_sort_index", pid=pid, tid=r["partition"],
                               args=dict(sort_index=r["partition"])))
        for e in d["entries"]:
            end = e["end_us"] or d["dumped_at_us"]
            name = e["op"] + ("" if e["state"] == "done" else f" ({e['state'] if e['end_us'] else 'stuck'})")
            args = {k: e[k] for k in ("call_site", "axis", "execution", "rank", "group", "dtype",
                                      "elements", "bytes", "algorithm", "state", "error")}
            events.append(dict(ph="X", name=name, cat="jaxcomm", pid=pid, tid=e["partition"],
                               ts=e["enqueue_us"] - t0, dur=max(end - e["enqueue_us"], 0), args=args))
            if e["start_us"] and e["start_us"] > e["enqueue_us"]:
                events.append(dict(ph="X", name="wait", cat="jaxcomm", pid=pid, tid=e["partition"],
                                   ts=e["enqueue_us"] - t0, dur=e["start_us"] - e["enqueue_us"]))
    doc = dict(traceEvents=events, displayTimeUnit="ms",
               otherData=dict(source="jaxcomm flight recorder", t0_us=t0))
    with open(out, "w") as f:
        json.dump(doc, f)
    return doc



#: Characters a line of the plot's title holds at its width (12 in at 9 pt).
TITLE_WIDTH = 150


def plot_title(verdict: str) -> str:
    """The analyzer's verdict as the plot's title: program hashes shortened to their first
    8 hex digits (the full ones are in the report) and the text wrapped at word boundaries
    on at most 3 lines, never cut inside a word or a hash.

    Example::

        >>> plot_title("MISMATCH: program 0123456789abcdef0123456789abcdef on process 1")
        'MISMATCH: program 01234567… on process 1'
    """
    short = re.sub(r"\b([0-9a-f]{8})[0-9a-f]{8,}\b", "\\1…", verdict)
    return textwrap.fill(short, width=TITLE_WIDTH, max_lines=3, placeholder=" …")


def plot(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Plots bus bandwidth per op over time and the arrival-skew distribution to ``out``.

    Needs matplotlib (an optional dependency: ``pip install matplotlib``). Bus bandwidth
    of a call: its message size (nccl-tests conventions) over the time from the last
    rank's arrival to its end, times the op's bus factor.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from e
    dumps = analyzer.load(directory)
    calls, _ = analyzer.merge(dumps)
    report = analyzer.analyze(directory)
    t0 = min((e["enqueue_us"] for d in dumps for e in d["entries"]), default=0)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for c in calls.values():
        done = [e for e in c.entries.values() if e["state"] == "done" and e["end_us"]]
        if not done:
            continue
        start = max(e["enqueue_us"] for e in done)
        end = max(e["end_us"] for e in done)
        n = len(c.group)
        size = message_bytes(c.op, done[0]["bytes"], n)
        busbw = size / max(end - start, 1) / 1e3 * bus_factor(c.op, n)  # bytes/us -> GB/s
        xs, ys = series.setdefault(c.op, ([], []))
        xs.append((end - t0) / 1e6)
        ys.append(busbw)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for op, (xs, ys) in sorted(series.items()):
        ax1.plot(xs, ys, ".", label=op, alpha=0.7)
    if any(ys for _, ys in series.values()):
        ax1.set_yscale("log")  # sizes of a run span orders of magnitude
    ax1.set_xlabel("time since first call (s)")
    ax1.set_ylabel("bus bandwidth (GB/s)")
    ax1.set_title("bus bandwidth per call")
    if series:
        ax1.legend()
    skews = report.skew_ms
    if skews:
        ax2.hist(skews, bins=min(50, max(5, len(skews) // 4)))
    ax2.set_xlabel("arrival skew: last rank - first rank (ms)")
    ax2.set_ylabel("calls")
    ax2.set_title(f"arrival skew ({len(skews)} completed calls)")
    fig.suptitle(plot_title(report.verdict), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
