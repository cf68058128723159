"""jaxcomm against mpi4jax: ``python -m jaxcomm.bench.mpi4jax_compare [options]``.

The same as ``python -m jaxcomm.bench --processes N [options]`` (see
:mod:`jaxcomm.bench.multiprocess`), which compares with mpi4jax whenever ``mpirun``,
mpi4py and mpi4jax are installed; this entry point says so when they are not, and exits
0 without measuring. ``--processes`` defaults to 2 here.

Install: an MPI (Debian: ``apt-get install openmpi-bin libopenmpi-dev``), then ``pip
install mpi4py mpi4jax`` (with ``nvcc`` on PATH mpi4jax also builds a CUDA bridge; set
``CUDA_PATH`` to an empty directory to build it for the CPU only).
"""

from __future__ import annotations

import sys
from typing import Sequence

from jaxcomm.bench import multiprocess, options


def missing() -> str:
    """Why the comparison cannot run here, or ""."""
    return multiprocess.mpi4jax_missing()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--processes" or a.startswith("--processes=") for a in argv):
        argv = ["--processes", "2", *argv]
    options.parse(argv)  # --help and bad options, whether or not mpi4jax is here
    why = missing()
    if why:
        print(f"mpi4jax comparison skipped: {why} (apt-get install openmpi-bin libopenmpi-dev; "
              "pip install mpi4py mpi4jax)")
        return 0
    return multiprocess.main(argv)

if __name__ == "__main__":
    sys.exit(main())
