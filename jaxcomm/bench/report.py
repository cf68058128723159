"""Output of the benchmarks: tables (rich if importable, else plain text), JSON, plots.

Works on the records :func:`jaxcomm.bench.collectives.run` returns (plain dicts), so a
saved JSON file can be re-plotted: ``report.plot(json.load(open(f)), "out.png")``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Iterable, Sequence, TextIO

from jaxcomm.bench.common import format_bytes

Record = dict[str, Any]

# (header, record key, format) of each table column.
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("size", "bytes", "size"),
    ("count", "count", "d"),
    ("mode", "mode", "s"),
    ("jaxcomm us", "jaxcomm_us", ".2f"),
    ("algbw GB/s", "algbw_gbps", ".3g"),
    ("busbw GB/s", "busbw_gbps", ".3g"),
    ("xla us", "xla_us", ".2f"),
    ("xla busbw", "xla_busbw_gbps", ".3g"),
    ("local us", "local_us", ".2f"),
    ("xla/local", "xla_vs_local", ".2f"),
    ("ratio", "ratio", ".2f"),
    ("ok", "match", "ok"),
)

#: The DESIGN targets the summary checks: (label, predicate on a record, minimum ratio).
TARGETS: tuple[tuple[str, Any, float], ...] = (
    ("all_reduce/ppermute latency, 4B..4KiB: <= 0.1x XLA's time",
     lambda r: r["op"] in ("all_reduce", "ppermute") and r["bytes"] <= 4096, 10.0),
    ("every op at >= 1MiB: at least XLA's throughput",
     lambda r: r["bytes"] >= 1 << 20, 1.0),
    ("all_to_all at 16MiB: >= 2x XLA",
     lambda r: r["op"] == "all_to_all" and r["bytes"] == 16 << 20, 2.0),
)


def _cell(rec: Record, key: str, fmt: str) -> str:
    """One table cell: ``ERR`` where a side failed, ``-`` where a figure is missing."""
    value = rec.get(key)
    if fmt == "ok":
        return {True: "yes", False: "NO", None: "-"}[value]
    if value is None:
        return "ERR" if key in ("jaxcomm_us", "xla_us") and rec.get("error") else "-"
    if fmt == "size":
        return format_bytes(int(value))
    return format(value, fmt)


def _groups(records: Iterable[Record]) -> list[tuple[tuple[Any, str], list[Record]]]:
    """Records grouped by (hugetlb, op), in order of first appearance."""
    out: dict[tuple[Any, str], list[Record]] = {}
    for rec in records:
        out.setdefault((rec.get("hugetlb"), rec["op"]), []).append(rec)
    return list(out.items())


def _title(rec: Record) -> str:
    """A table's caption, from any record of its group."""
    huge = {True: "on", False: "off"}.get(rec.get("hugetlb"), "?")
    procs = rec.get("processes") or 1
    where = (f"{procs} processes x {rec['devices'] // procs} devices" if procs > 1
             else f"{rec['devices']} devices")
    return (f"{rec['op']}  ({where}, {rec['dtype']}, hugetlb {huge}; "
            f"ratio = xla time / jaxcomm time)")


def format_table(records: Sequence[Record]) -> str:
    """One plain-text table (nccl-tests layout) for records of one op and setting."""
    rows = [[_cell(r, key, fmt) for _, key, fmt in _COLUMNS] for r in records]
    heads = [h for h, _, _ in _COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(heads)]
    lines = [f"# {_title(records[0])}" if records else "#",
             "  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    errors = [f"#   {format_bytes(r['bytes'])}: {r['error']}" for r in records if r.get("error")]
    return "\n".join(lines + (["# errors:"] + errors if errors else []))


def print_tables(records: Sequence[Record], file: TextIO | None = None) -> None:
    """Prints one table per (hugetlb setting, op): with rich if importable."""
    file = sys.stdout if file is None else file
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for _, group in _groups(records):
            print(format_table(group) + "\n", file=file)
        return
    console = Console(file=file)
    if not console.is_terminal:
        console = Console(file=file, width=150)  # else rich wraps at 80 columns in files
    for _, group in _groups(records):
        table = Table(title=_title(group[0]), title_justify="left")
        for head, _, _ in _COLUMNS:
            table.add_column(head, justify="right", no_wrap=True)
        for rec in group:
            cells = [_cell(rec, key, fmt) for _, key, fmt in _COLUMNS]
            ratio = rec.get("ratio")
            if ratio is not None:
                cells[-2] = f"[{'green' if ratio >= 1 else 'red'}]{cells[-2]}[/]"
            if rec.get("match") is False:
                cells[-1] = f"[bold red]{cells[-1]}[/]"
            table.add_row(*cells)
        console.print(table)
        for rec in group:
            if rec.get("error"):
                console.print(f"  {format_bytes(rec['bytes'])}: {rec['error']}", markup=False,
                              style="red")


def print_header(env: dict[str, Any], file: TextIO | None = None) -> None:
    """One comment line describing the run, as nccl-tests starts its output."""
    file = sys.stdout if file is None else file
    print("# jaxcomm collective benchmark: " + "  ".join(f"{k}={v}" for k, v in env.items()),
          file=file, flush=True)


def _verdict(rec: Record) -> str:
    """A record's ratio as the target summary shows it."""
    if rec.get("ratio") is None:
        return "ERR"
    ceiling = rec.get("xla_vs_local")
    return (f"{rec['ratio']:.2f}x"
            + (f" (xla/local {ceiling:.2f}x)" if ceiling is not None else "")
            + (" (wrong result)" if rec.get("match") is False else ""))


def target_lines(records: Sequence[Record],
                 targets: Sequence[tuple[str, Any, float]] = TARGETS) -> list[str]:
    """One line per target and hugetlb setting: met, or the cases that miss it.

    ``targets``: (label, predicate on a record, minimum ratio) each; default: DESIGN's.
    """
    lines = []
    settings = sorted({r.get("hugetlb") for r in records}, key=lambda s: (s is None, s))
    for label, applies, minimum in targets:
        for setting in settings:
            cases = [r for r in records if r.get("hugetlb") == setting and applies(r)]
            if not cases:
                continue
            misses = [r for r in cases if r.get("ratio") is None or r["ratio"] < minimum
                      or r.get("match") is False]
            huge = {True: "on", False: "off"}.get(setting, "?")
            if not misses:
                lines.append(f"met    [hugetlb {huge}] {label} ({len(cases)} cases)")
            else:
                worst = ", ".join(f"{r['op']}@{format_bytes(r['bytes'])}=" + _verdict(r)
                                  for r in misses)
                lines.append(f"MISSED [hugetlb {huge}] {label}: {worst}")
    return lines


def print_targets(records: Sequence[Record], file: TextIO | None = None,
                  targets: Sequence[tuple[str, Any, float]] = TARGETS) -> None:
    """Prints :func:`target_lines` under a heading (nothing if no record applies)."""
    lines = target_lines(records, targets)
    if lines:
        file = sys.stdout if file is None else file
        print("# targets (ratio = xla time / jaxcomm time; xla/local = xla time / the time "
              "XLA takes to move the same bytes without communicating)", file=file)
        for line in lines:
            print("  " + line, file=file)


def finish(records: Sequence[Record], json_path: str | None = None,
           plot_path: str | None = None,
           targets: Sequence[tuple[str, Any, float]] = TARGETS) -> bool:
    """Ends a benchmark run: the target summary, then JSON and plot files if asked.

    Returns whether some record failed or disagreed with XLA (the run's exit status 1).
    """
    print_targets(records, targets=targets)
    if json_path:
        write_json(records, json_path)
        print(f"wrote {json_path}")
    if plot_path and records:
        plot(records, plot_path)
        print(f"wrote {plot_path}")
    return any(r["error"] or r["match"] is False for r in records)


def write_json(records: Sequence[Record], path: str) -> None:
    """Writes the records as one JSON list (NaN-free: missing figures are null)."""
    with open(path, "w") as f:
        json.dump(list(records), f, indent=1)
        f.write("\n")


def plot(records: Sequence[Record], path: str) -> None:
    """Bus bandwidth against size, jaxcomm and XLA, one log-log subplot per op.

    Colour tells jaxcomm from XLA; line style tells the hugetlb settings apart. Uses the
    Agg canvas directly, so it neither needs a display nor changes pyplot's backend.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ops = list(dict.fromkeys(r["op"] for r in records))
    settings = list(dict.fromkeys(r.get("hugetlb") for r in records))
    ncols = min(3, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 4.0 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    styles = {False: ("-", "o"), True: ("--", "s"), None: ("-", "o")}
    first = records[0]
    for ax, op in zip(axes, ops):
        for setting in settings:
            recs = sorted((r for r in records if r["op"] == op and r.get("hugetlb") == setting),
                          key=lambda r: r["bytes"])
            line, marker = styles.get(setting, ("-", "o"))
            huge = {True: " (hugetlb)", False: "", None: ""}[setting]
            if len(settings) > 1 and setting is False:
                huge = " (no hugetlb)"
            for key, name, color in (("busbw_gbps", "jaxcomm", "C0"),
                                     ("xla_busbw_gbps", "XLA", "C3")):
                pts = [(r["bytes"], r[key]) for r in recs if r.get(key) and r[key] > 0]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, linestyle=line, marker=marker, markersize=3.5, color=color,
                            label=f"{name}{huge}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # Plain numbers ("0.01", "2") read faster than 10^k powers; minor labels would crowd.
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(LogLocator(base=4))
        ax.xaxis.set_major_formatter(
            FuncFormatter(lambda v, _: format_bytes(int(v)) if v >= 1 else ""))
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.set_title(op)
        ax.set_xlabel("size per device")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.1)
        # Latency (looped) and single-call figures are measured differently: mark the seam.
        looped = [r["bytes"] for r in records if r["op"] == op and r.get("mode") == "loop"]
        called = [r["bytes"] for r in records if r["op"] == op and r.get("mode") == "call"]
        if looped and called:
            seam = math.sqrt(max(looped) * min(called))
            ax.axvline(seam, color="0.5", linestyle=":", linewidth=1)
            ax.text(seam, 0.02, " 1 call/program ", transform=ax.get_xaxis_transform(),
                    fontsize=6.5, color="0.4", ha="left", va="bottom")
            ax.text(seam, 0.02, " looped (latency) ", transform=ax.get_xaxis_transform(),
                    fontsize=6.5, color="0.4", ha="right", va="bottom")
        # Bandwidth rises with size, so the upper left corner is where the lines are not.
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes[len(ops):]:
        ax.set_visible(False)
    fig.suptitle(f"jaxcomm vs XLA collectives: {first['devices']} devices, {first['dtype']}")
    fig.savefig(path, dpi=110)
