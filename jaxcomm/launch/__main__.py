"""``python -m jaxcomm.launch -n N [options] script.py [args ...]``: see :mod:`jaxcomm.launch`."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxcomm import launch as _launch


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command line; everything after the script belongs to the script."""
    p = argparse.ArgumentParser(
        prog="python -m jaxcomm.launch",
        description="Runs a script as N processes of one JAX job on this machine (the "
                    "script calls jaxcomm.init() first). Output lines are prefixed with "
                    "the process index; when one process fails the others get --grace seconds, "
                    "then are terminated, and the launcher exits with the status of the "
                    "process the others' errors lead back to. JAX's coordination service "
                    "runs in a process of the launcher's, so any process may die.",
        epilog="Environment given to each process: JAXCOMM_COORDINATOR, "
               "JAXCOMM_NUM_PROCESSES, JAXCOMM_PROCESS_ID, JAXCOMM_LOCAL_DEVICES, "
               "JAXCOMM_JOB_ID, JAXCOMM_LAUNCHER_PID, JAXCOMM_COORDINATION_SERVICE, "
               "JAXCOMM_JOB_SECRET, and XLA_FLAGS with "
               "--xla_force_host_platform_device_count.")
    p.add_argument("-n", "--nprocs", "--processes", dest="n", type=int, required=True,
                   help="number of processes")
    p.add_argument("-d", "--devices-per-process", dest="devices", type=int, default=1,
                   help="CPU devices per process (default %(default)s)")
    p.add_argument("--grace", type=float, default=_launch.DEFAULT_GRACE_S, metavar="SECONDS",
                   help="after a process fails, how long the others may run on to report "
                        "their own errors (default %(default)g)")
    p.add_argument("--keep-going", action="store_true",
                   help="a failed process does not stop the others (fault-tolerant jobs, "
                        "jaxcomm.ft); the exit status still reports the first failure")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help=f"terminate the job after this long, exit status "
                        f"{_launch.TIMEOUT_EXIT} (default: no limit)")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--job-id", default=None,
                   help="JAXCOMM_JOB_ID, letters and digits (default: random)")
    p.add_argument("--bind", choices=("none", "cores"), default="none",
                   help="cores: with no more processes than cores, each process runs on its "
                        "own share of them, as mpirun binds (small collectives between "
                        "processes then take ~2 us, not ~20, but XLA's thread pools and gloo "
                        "collectives share those cores); none: the scheduler places them "
                        "(default %(default)s)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="the target is a module, run as python -m MODULE")
    p.add_argument("target", help="script.py (run with this Python), module (with -m), or "
                                  "a program")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the target")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, runs the job, returns the launcher's exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"-n must be at least 1, got {args.n}")
    if args.devices < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices}")
    if args.grace < 0:
        parser.error(f"--grace must be >= 0, got {args.grace}")
    try:
        res = _launch.launch([args.target, *args.args], args.n,
                             devices_per_process=args.devices, grace_s=args.grace,
                             timeout_s=args.timeout, module=args.module, job_id=args.job_id,
                             port=args.port, forward_signals=True,
                             keep_going=args.keep_going, bind=args.bind)
    except (ValueError, RuntimeError) as exc:
        print(f"jaxcomm.launch: {exc}", file=sys.stderr)
        return 2
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
