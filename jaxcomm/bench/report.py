"""Output of the collective benchmark: its tables and summary lines, JSON, plots.

One format for every run, in one process or several (:mod:`jaxcomm.bench.measure` makes
the records, plain dicts): per op, one row per size with each side's cost per collective
(b of a + b*n) and per call (a), the ratio of every peer's b to jaxcomm's, the same
ratio through each loop length's fastest call, and whether the results matched; a
caption that states the processes, devices, placement, the command that started them
and the load average; then one line per peer saying where jaxcomm is behind. A saved
JSON file can be printed again (:func:`print_report` after :func:`refit`) or plotted.
Nothing here imports jax.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from typing import Any, Callable, Iterable, Sequence

from jaxcomm.bench import common, method

Record = dict[str, Any]

#: Every side, in the order of the tables; "jaxcomm" is the one the others are compared to.
SIDES = ("jaxcomm", "xla", "gloo", "mpi4jax", "plain")
#: The sides compared with jaxcomm ("plain" is the fixed cost's reference only).
PEERS = ("xla", "gloo", "mpi4jax")
PLACEMENTS = {"cores": "bound: a core (share of the cores) per process",
              "none": "not bound: the scheduler places the processes",
              "process": "one process: the scheduler places its threads"}

#: DESIGN's targets against XLA in one process: (label, predicate on a record, minimum
#: ratio of XLA's time per collective to jaxcomm's).
TARGETS: tuple[tuple[str, Callable[[Record], bool], float], ...] = (
    ("all_reduce/ppermute latency, 4B..4KiB: <= 0.1x XLA's time",
     lambda r: r["op"] in ("all_reduce", "ppermute") and r["bytes"] <= 4096, 10.0),
    ("every op at >= 1MiB: at least XLA's throughput",
     lambda r: r["bytes"] >= 1 << 20, 1.0),
    ("all_to_all at 16MiB: >= 2x XLA",
     lambda r: r["op"] == "all_to_all" and r["bytes"] == 16 << 20, 2.0),
)


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def job_key(rec: Record) -> tuple[Any, ...]:
    """What tells the records of one job (one placement, one setting) from another's."""
    return (rec.get("processes", 1), rec.get("devices"), rec.get("hosts", 1), rec.get("bind"),
            rec.get("hugetlb"), rec.get("started_by"))


def job_label(rec: Record) -> str:
    """A short name of a record's job for the summary lines: ``[cores]``, ``[none, 2 hosts]``,
    ``[one process, hugetlb off]``."""
    parts = ["one process" if rec.get("processes", 1) == 1 else rec.get("bind", "?")]
    if rec.get("hosts", 1) > 1:
        parts.append(f"{rec['hosts']} hosts")
    if rec.get("hugetlb"):
        parts.append("hugetlb on")
    return "[" + ", ".join(parts) + "]"


def caption(rec: Record) -> str:
    """A table's first line, from any record of it: what ran where, started how, at what
    load."""
    procs = rec.get("processes", 1)
    devs = rec["devices"] // procs
    where = (f"{procs} process{'es' if procs > 1 else ''} x {devs} device{'s' if devs > 1 else ''}"
             + (f" as {rec['hosts']} hosts" if rec.get("hosts", 1) > 1 else ""))
    return (f"# {rec['op']}: {where}, {rec['dtype']}; "
            f"{PLACEMENTS.get(rec.get('bind'), rec.get('bind'))} ({rec.get('started_by', '?')}); "
            f"hugetlb {'on' if rec.get('hugetlb') else 'off'}; "
            f"load average {rec.get('load_after', rec.get('load', '?'))}")


def format_table(records: Sequence[Record]) -> str:
    """One op's rows of one job: per collective and per call, every side, with ratios."""
    sides = [s for s in SIDES if any(s in r["sides"] for r in records)]
    peers = [s for s in sides if s in PEERS]
    head = ["size", "lengths", "jaxcomm"]
    for p in peers:
        head += [p, f"{p}/jaxcomm"]
    head += ["|"] + [f"{s} /call" for s in sides] + ["|", "fastest:"] + \
        [f"{p}/jaxcomm" for p in peers] + ["ok"]
    rows = []
    for r in records:
        row = [common.format_bytes(r["bytes"]), ",".join(map(str, r["lengths"])),
               _fmt(r.get("jaxcomm_per_collective_us"))]
        for p in peers:
            row += [_fmt(r.get(f"{p}_per_collective_us")),
                    _fmt(method.ratio(r.get(f"{p}_per_collective_us"), r.get("jaxcomm_per_collective_us")))]
        row += ["|"] + [_fmt(r.get(f"{s}_per_call_us"), ".1f") for s in sides] + ["|", ""]
        row += [_fmt(method.ratio(r.get(f"{p}_best_per_collective_us"), r.get("jaxcomm_best_per_collective_us")))
                for p in peers]
        row.append("ERR" if r["error"] else ("NO" if False in r["match"].values() else "yes"))
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [caption(records[0]),
             "# us per collective (b of a + b*n through the median call of each loop length; "
             "ratio = peer / jaxcomm, above 1: jaxcomm faster), us per call (a), and the "
             "ratios of b through each length's fastest call",
             "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"#   {common.format_bytes(r['bytes'])}: {r['error']}" for r in records if r["error"]]
    return "\n".join(lines)


def summary_lines(records: Sequence[Record]) -> list[str]:
    """For the records of one job: one line per peer (where jaxcomm is behind too), and
    the fixed costs per call against a plain jit's."""
    lines = []
    for peer in PEERS:
        rows = [r for r in records if peer in r["sides"]]
        if rows:
            lines.append(method.summary_line(peer, rows))
    calls = {s: [r[f"{s}_per_call_us"] for r in records if r.get(f"{s}_per_call_us") is not None]
             for s in SIDES}
    if calls["jaxcomm"] and calls["plain"]:
        ours, plain = statistics.median(calls["jaxcomm"]), statistics.median(calls["plain"])
        lines.append(f"fixed cost per call (median over cases): jaxcomm {ours:.1f} us, plain jit "
                     f"{plain:.1f} us ({_fmt(method.ratio(ours, plain))}x)"
                     + "".join(f", {p} {statistics.median(calls[p]):.1f} us"
                               for p in PEERS if calls[p]))
    return lines


def report_lines(records: Sequence[Record], targets: bool = False) -> list[str]:
    """Every job's tables (one per op) and summary lines, in the order they ran; with
    ``targets``, also whether the project's own targets against XLA (:data:`TARGETS`) are
    met: a project check, not something a user's run has to meet."""
    out = []
    for key in dict.fromkeys(job_key(r) for r in records):
        mine = [r for r in records if job_key(r) == key]
        for op in dict.fromkeys(r["op"] for r in mine):
            out += [format_table([r for r in mine if r["op"] == op]), ""]
        out += [f"# {job_label(mine[0])} {line}" for line in summary_lines(mine)]
        if targets:
            out += [f"# {job_label(mine[0])} target {line}" for line in target_lines(mine)]
    return out


def print_report(records: Sequence[Record], targets: bool = False) -> None:
    """Prints :func:`report_lines`."""
    for line in report_lines(records, targets):
        print(line, flush=True)


def target_lines(records: Sequence[Record],
                 targets: Sequence[tuple[str, Callable[[Record], bool], float]] = TARGETS) -> list[str]:
    """Against XLA (one process): one line per target, met or the cases that miss it."""
    lines = []
    for label, applies, minimum in targets:
        cases = [r for r in records if "xla" in r["sides"] and applies(r)]
        if not cases:
            continue
        ratios = [(r, method.ratio(r.get("xla_per_collective_us"), r.get("jaxcomm_per_collective_us")))
                  for r in cases]
        misses = [(r, q) for r, q in ratios if q is None or q < minimum or False in r["match"].values()]
        if not misses:
            lines.append(f"met: {label} ({len(cases)} cases)")
        else:
            lines.append(f"MISSED: {label}: " + ", ".join(
                f"{r['op']} {common.format_bytes(r['bytes'])} {_fmt(q)}x" for r, q in misses))
    return lines


def refit(records: Iterable[Record]) -> list[Record]:
    """The records with every side's a and b fitted again from their saved medians
    (:func:`jaxcomm.bench.method.fit`): a saved run re-read by ``--show``."""
    out = []
    for r in records:
        r = dict(r)
        for side, fig in r["sides"].items():
            f = method.fit({int(m): [t] for m, t in fig["medians_us"].items()})
            r[f"{side}_per_call_us"], r[f"{side}_per_collective_us"] = f.per_call_us, f.per_collective_us
            if "fastest_us" in fig:
                best = method.fit({int(m): [t] for m, t in fig["fastest_us"].items()})
                r[f"{side}_best_per_collective_us"] = best.per_collective_us
        out.append(r)
    return out


def failed(records: Iterable[Record]) -> bool:
    """Whether some case failed or some peer's result differed from jaxcomm's."""
    return any(r["error"] or False in r["match"].values() for r in records)


def write_json(records: Sequence[Record], path: str) -> None:
    """Writes the records as one JSON list (missing figures are null)."""
    with open(path, "w") as f:
        json.dump(list(records), f, indent=1)
        f.write("\n")


def read_json(path: str) -> list[Record]:
    """Records saved by :func:`write_json`, fitted again (:func:`refit`)."""
    with open(path) as f:
        return refit(json.load(f))


def busbw_gbps(rec: Record, side: str) -> float | None:
    """A side's bus bandwidth per collective (GB/s) from its b, by nccl-tests' factors."""
    from jaxcomm._src.stats import bus_factor
    b = rec.get(f"{side}_per_collective_us")
    if b is None or b <= 0:
        return None
    return rec["bytes"] / (b * 1e-6) / 1e9 * bus_factor(rec["op"], rec["devices"])


#: What each side's line is, for the plot's legend.
SIDE_LABELS = {"jaxcomm": "jaxcomm", "xla": "XLA's own (jax.lax, one process)",
               "gloo": "gloo (jax.lax across processes)", "mpi4jax": "mpi4jax (Open MPI)"}


def _padded_limits(values: Sequence[float], factor: float, min_span: float) -> tuple[float, float]:
    """Log-axis limits around ``values``: ``factor`` (or 6% of their span, if more) beyond
    the extremes, and at least ``min_span`` (a ratio) wide, so that points never sit on
    the panel's edges and a small gap between two lines does not fill a panel."""
    lo, hi = min(values), max(values)
    pad = math.exp(max(math.log(factor), 0.06 * math.log(hi / lo)))
    lo, hi = lo / pad, hi * pad
    if hi / lo < min_span:
        middle = math.sqrt(lo * hi)
        lo, hi = middle / math.sqrt(min_span), middle * math.sqrt(min_span)
    return lo, hi


def plot(records: Sequence[Record], path: str) -> None:
    """Writes :func:`figure` of ``records`` to ``path`` (a PNG)."""
    figure(records).savefig(path, dpi=110)


def figure(records: Sequence[Record]) -> Any:
    """Bus bandwidth per collective against size, every side but plain, one log-log
    subplot per op; line styles tell jobs (placements, hugetlb) apart. Every panel has
    labelled ticks on both axes and limits with room around its points (a panel of one
    point too). Uses the Agg canvas directly, so it needs no display and leaves pyplot's
    backend alone. Returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ops = list(dict.fromkeys(r["op"] for r in records))
    jobs = list(dict.fromkeys(job_key(r) for r in records))
    ncols = min(3, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 4.2 * nrows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    styles = ["-", "--", ":", "-."]
    colors = {s: f"C{i}" for i, s in enumerate(SIDES)}
    for ax, op in zip(axes, ops):
        xs_all: list[float] = []
        ys_all: list[float] = []
        for j, key in enumerate(jobs):
            recs = sorted((r for r in records if r["op"] == op and job_key(r) == key),
                          key=lambda r: r["bytes"])
            if not recs:
                continue
            label = job_label(recs[0]) if len(jobs) > 1 else ""
            for side in SIDES:
                if side == "plain":
                    continue
                pts = [(r["bytes"], busbw_gbps(r, side)) for r in recs]
                pts = [(x, y) for x, y in pts if y]
                if pts:
                    xs, ys = zip(*pts)
                    xs_all += xs
                    ys_all += ys
                    ax.plot(xs, ys, linestyle=styles[j % len(styles)], marker="o", markersize=4,
                            color=colors[side], label=f"{SIDE_LABELS.get(side, side)} {label}".strip())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if xs_all:
            # A factor of 2 beyond the sizes (8 on each side of a lone one): powers of 4
            # in view, so the size axis always has labelled ticks.
            ax.set_xlim(*_padded_limits(xs_all, 2.0, 64.0))
            # Bandwidth spans decades: at least one in view, so that a small gap looks small.
            lo, hi = _padded_limits(ys_all, 1.6, 10.0)
            ax.set_ylim(lo, hi)
        else:
            lo, hi = 1.0, 10.0
        # Labelled ticks at 1, 2 and 5 of each decade where few decades show (one-point
        # panels included), at the decades alone where many do. Plain numbers ("0.01",
        # "2") read faster than 10^k powers.
        subs = (1.0, 2.0, 5.0) if math.log10(hi / lo) <= 2.5 else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=9))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(LogLocator(base=4))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: common.format_bytes(int(v)) if v >= 1 else ""))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_title(op)
        ax.set_xlabel("message size per device")
        ax.set_ylabel("bus bandwidth (GB/s, higher is faster)")
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.1)
    for ax in axes[len(ops):]:
        ax.set_visible(False)
    # One legend for every panel (the sides and jobs are the same), below them: in a
    # panel it would cover lines.
    handles: dict[str, Any] = {}
    for ax in axes[:len(ops)]:
        for h, text in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(text, h)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncols=max(1, min(len(handles), 2 * ncols)), fontsize=8)
    first = records[0]
    procs = first.get("processes", 1)
    per = first["devices"] // procs
    where = (f"{procs} processes x {per} device{'s' if per > 1 else ''}" if procs > 1
             else f"one process, {first['devices']} devices")
    title = [f"Bus bandwidth per collective (nccl-tests' definition, from the time per "
             f"collective of loops of several lengths) against message size",
             f"jaxcomm and {', '.join(SIDE_LABELS.get(s, s) for s in _peers_in(records))}; "
             f"{where}, {first['dtype']}"]
    # About 11 characters of an 11-point title per inch of figure.
    width = int(11 * 5.2 * ncols)
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title), fontsize=11)
    return fig


def _peers_in(records: Sequence[Record]) -> list[str]:
    return [s for s in PEERS if any(s in r["sides"] for r in records)]
