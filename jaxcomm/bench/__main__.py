"""``python -m jaxcomm.bench``: dispatches to a benchmark subcommand.

    python -m jaxcomm.bench [collective options]   collectives vs XLA (jaxcomm.bench.collectives)
    python -m jaxcomm.bench collectives [options]  the same, named explicitly
    python -m jaxcomm.bench --processes N [...]    the same across N processes (multiprocess)
    python -m jaxcomm.bench moe [moe options]      MoE dispatch/combine (jaxcomm.bench.moe)

Subcommands parse their own arguments before anything creates a JAX backend, so they can
still set ``XLA_FLAGS`` (the emulated device count).
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the subcommand named by ``argv[0]`` (default: collectives); its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "moe":
        try:
            moe = importlib.import_module("jaxcomm.bench.moe")
        except ModuleNotFoundError as exc:
            if exc.name != "jaxcomm.bench.moe":
                raise  # moe.py exists but something it imports does not
            print("python -m jaxcomm.bench moe: the MoE benchmark (jaxcomm/bench/moe.py) is "
                  "not part of this installation of jaxcomm", file=sys.stderr)
            return 2
        return int(moe.main(argv[1:]) or 0)
    if argv and argv[0] == "collectives":
        argv = argv[1:]
    if any(a == "--processes" or a.startswith("--processes=") for a in argv):
        from jaxcomm.bench import multiprocess
        return multiprocess.main(argv)
    from jaxcomm.bench import collectives
    return collectives.main(argv)


if __name__ == "__main__":
    sys.exit(main())
