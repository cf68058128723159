"""``python -m jaxcomm.bench``: dispatches to a benchmark subcommand.

    python -m jaxcomm.bench [options]                  collectives in one process, vs XLA
    python -m jaxcomm.bench --processes N [options]    the same across N processes, vs gloo,
                                                       mpi4jax and a plain jit
    python -m jaxcomm.bench collectives [options]      the same two, named explicitly
    python -m jaxcomm.bench docs [--quick]             every table of docs/benchmarks.md
    python -m jaxcomm.bench instructions [options]     instructions per collective (callgrind)
    python -m jaxcomm.bench moe [options]              MoE dispatch/combine
    python -m jaxcomm.bench dropin [options]           jax.lax.pmean with use_for_lax()
    python -m jaxcomm.bench faults [options]           fault detection, recorder overhead
    python -m jaxcomm.bench startup [options]          start-up at N processes, vs jax + gloo

Each has a ``--help``; ``python -m jaxcomm.bench --help`` lists them (jaxcomm.bench.options).

Subcommands parse their own arguments before anything creates a JAX backend, so they can
still set ``XLA_FLAGS`` (the emulated device count).
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the subcommand named by ``argv[0]`` (default: collectives); its exit status."""
    from jaxcomm.bench import options
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in options.SUBCOMMANDS:
        name = options.SUBCOMMANDS[argv[0]][0]
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise  # the module exists but something it imports does not
            print(f"python -m jaxcomm.bench {argv[0]}: not part of this installation of jaxcomm",
                  file=sys.stderr)
            return 2
        return int(module.main(argv[1:]) or 0)
    if argv and argv[0] == "collectives":
        argv = argv[1:]
    args = options.parse(argv)
    if args.processes > 1 and not args.show:
        from jaxcomm.bench import multiprocess
        return multiprocess.main(argv)
    from jaxcomm.bench import collectives
    return collectives.main(argv)


if __name__ == "__main__":
    sys.exit(main())
