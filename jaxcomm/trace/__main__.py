"""``python -m jaxcomm.trace``: analyze, export and measure the flight recorder.

  analyze DIR [--straggler-ms 250] [--stuck-s 5]
      Merges the dumps in DIR; prints one verdict line, then the details. Exit status:
      0 clean, 1 a fault (stuck, missing, dead or mismatched ranks, failed calls),
      2 stragglers only.
  export DIR [--perfetto out.json] [--plot out.png]
      A Chrome trace (one track per rank) and/or a plot of bus bandwidth per op over
      time and of the arrival-skew distribution (needs matplotlib).
  overhead [--devices 8] [--rounds 15]
      The recorder's cost on all_reduce (4 B latency, 16 MiB time), on vs off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxcomm.trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="merge the dumps of a job and find the faulty ranks")
    a.add_argument("dir")
    a.add_argument("--straggler-ms", type=float, default=250.0,
                   help="arrival skew that makes a straggler (default 250 ms)")
    a.add_argument("--stuck-s", type=float, default=5.0,
                   help="a call pending this long at dump time is stuck (default 5 s)")
    a.add_argument("--json", action="store_true", help="print the findings as JSON")
    e = sub.add_parser("export", help="Perfetto timeline and/or bandwidth/skew plot")
    e.add_argument("dir")
    e.add_argument("--perfetto", metavar="OUT.json")
    e.add_argument("--plot", metavar="OUT.png")
    o = sub.add_parser("overhead", help="measure the recorder's cost (on vs off, one run)")
    o.add_argument("--devices", type=int, default=8)
    o.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)

    if args.cmd == "analyze":
        from jaxcomm.trace import analyzer

        report = analyzer.analyze(args.dir, straggler_ms=args.straggler_ms, stuck_s=args.stuck_s)
        if args.json:
            import dataclasses

            print(json.dumps(dict(verdict=report.verdict, kind=report.kind,
                                  exit_code=report.exit_code,
                                  findings=[dataclasses.asdict(f) for f in report.findings]),
                             indent=1))
        else:
            print(report.text())
        return report.exit_code
    if args.cmd == "export":
        from jaxcomm.trace import exporter

        if not (args.perfetto or args.plot):
            p.error("export needs --perfetto and/or --plot")
        if args.perfetto:
            doc = exporter.perfetto(args.dir, args.perfetto)
            tracks = {(ev["pid"], ev["tid"]) for ev in doc["traceEvents"] if ev["ph"] == "X"}
            print(f"wrote {args.perfetto}: {len(tracks)} rank tracks (open in ui.perfetto.dev)")
        if args.plot:
            exporter.plot(args.dir, args.plot)
            print(f"wrote {args.plot}")
        return 0
    # overhead: the device count must be in XLA_FLAGS before jax loads.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    from jaxcomm.trace import overhead

    print(overhead.report(overhead.measure(rounds=args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
