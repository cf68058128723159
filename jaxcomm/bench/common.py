"""Helpers shared by the benchmark subcommands: sizes, process setup, progress display.

Nothing here imports jax, so a command line can be parsed and the process configured
(``XLA_FLAGS``, ``GLIBC_TUNABLES``) before any JAX backend exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any, Mapping, Sequence

#: Binary units, as nccl-tests reads ``-b 8 -e 128M``: K, KB and KiB all mean 1024.
_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
          "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_HUGETLB_TUNABLE = "glibc.malloc.hugetlb"


# ------------------------------------------------------------------------------- sizes

def parse_size(text: str) -> int:
    """``"4B"``, ``"64KiB"``, ``"1M"``, ``"4096"`` -> bytes (binary units)."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; expected e.g. 4B, 64KiB, 16MiB, 1GiB")
    value = float(m.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def parse_sizes(spec: str, factor: int = 2) -> list[int]:
    """``"start:end"`` -> ``[start, start*factor, ...]`` up to ``end``; ``"N"`` -> ``[N]``.

    A comma list of sizes (``"4B,1MiB"``) is also accepted and taken as is.
    """
    if factor < 2:
        raise ValueError(f"the size factor must be an integer >= 2, got {factor}")
    if "," in spec:
        return [parse_size(s) for s in spec.split(",") if s.strip()]
    if ":" not in spec:
        return [parse_size(spec)]
    lo_text, hi_text = spec.split(":", 1)
    lo, hi = parse_size(lo_text), parse_size(hi_text)
    if lo <= 0 or hi < lo:
        raise ValueError(f"size range {spec!r} must satisfy 0 < start <= end")
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        size *= factor
    return sizes


def format_bytes(n: int) -> str:
    """4 -> ``"4B"``, 65536 -> ``"64KiB"``, 1572864 -> ``"1.5MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{n}B"


def short_error(exc: BaseException, limit: int = 400) -> str:
    """An exception as one bounded line for a table footnote."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[:limit] + " ..."


# --------------------------------------------------------------------------- process setup

def set_host_device_count(n: int) -> None:
    """Makes XLA:CPU expose ``n`` devices, replacing any count already in ``XLA_FLAGS``.

    Only acts if no JAX backend exists yet in this process (XLA reads the flag when the
    CPU client is created); :func:`jaxcomm.bench.collectives.run` checks the count later.
    """
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", "")).split()
    flags.append(f"--xla_force_host_platform_device_count={int(n)}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def hugetlb_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``GLIBC_TUNABLES`` asks malloc for huge pages (``glibc.malloc.hugetlb`` != 0).

    glibc reads the tunable at process start, so this describes the running process only
    if ``env`` is the environment it was started with (the default, ``os.environ``).
    """
    env = os.environ if env is None else env
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        key, _, value = item.partition("=")
        if key.strip() == _HUGETLB_TUNABLE:
            return value.strip() not in ("", "0")
    return False


def hugetlb_env(on: bool, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` whose ``GLIBC_TUNABLES`` turns malloc's huge pages on or off.

    ``glibc.malloc.hugetlb=1`` makes malloc ``madvise`` its large blocks for transparent
    huge pages, so a fresh output buffer faults in 2 MiB at a time instead of 4 KiB.
    """
    env = dict(os.environ if env is None else env)
    items = [i for i in env.get("GLIBC_TUNABLES", "").split(":")
             if i and i.partition("=")[0].strip() != _HUGETLB_TUNABLE]
    if on:
        items.append(f"{_HUGETLB_TUNABLE}=1")
    if items:
        env["GLIBC_TUNABLES"] = ":".join(items)
    else:
        env.pop("GLIBC_TUNABLES", None)
    return env


def transparent_hugepage_mode() -> str:
    """The kernel's THP setting (``always``/``madvise``/``never``), or ``"unknown"``.

    glibc's hugetlb=1 only helps where this is ``always`` or ``madvise``.
    """
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else "unknown"


def run_module_child(module_args: Sequence[str], env: dict[str, str]) -> int:
    """Runs ``python -m jaxcomm.bench <module_args>`` with ``env``; returns its exit status.

    The child inherits stdin/stderr so its progress display shows in this terminal; its
    stdout goes to our stderr, keeping this process's stdout for the tables.
    """
    cmd = [sys.executable, "-m", "jaxcomm.bench", *module_args]
    return subprocess.run(cmd, env=env, stdout=sys.stderr, check=False).returncode


# ------------------------------------------------------------------------------- progress

class ProgressDisplay:
    """A progress bar on stderr: rich if importable, else tqdm, else one line per step
    (also when stderr is not a terminal).

    Use as a context manager; call :meth:`step` before each unit of work and
    :meth:`note` for messages that must not be overwritten by the bar.
    """

    def __init__(self, total: int, title: str = "", enabled: bool = True) -> None:
        self.total = total
        self.title = title
        self.enabled = enabled
        self._done = 0
        self._rich: Any = None
        self._task: Any = None
        self._tqdm: Any = None

    def __enter__(self) -> "ProgressDisplay":
        if not self.enabled:
            return self
        if not sys.stderr.isatty():
            return self  # a bar redrawn in a log file is noise: one line per step instead
        try:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
        except ImportError:
            pass
        else:
            self._rich = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=Console(stderr=True))
            self._rich.start()
            self._task = self._rich.add_task(self.title, total=self.total)
            return self
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            self._tqdm = tqdm(total=self.total, desc=self.title, file=sys.stderr)
        return self

    def step(self, description: str) -> None:
        """Marks the previous step done and announces the next one."""
        if not self.enabled:
            return
        label = f"{self.title} {description}".strip()
        if self._rich is not None:
            self._rich.update(self._task, completed=self._done, description=label)
        elif self._tqdm is not None:
            self._tqdm.n = self._done
            self._tqdm.set_description(label)
        else:
            print(f"[{self._done + 1}/{self.total}] {label}", file=sys.stderr, flush=True)
        self._done += 1

    def note(self, message: str) -> None:
        """Prints ``message`` to stderr above the bar (always, even when disabled)."""
        if self._rich is not None:
            self._rich.console.print(message, markup=False, highlight=False)
        elif self._tqdm is not None:
            self._tqdm.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.update(self._task, completed=self._done)
            self._rich.stop()
        elif self._tqdm is not None:
            self._tqdm.n = self._done
            self._tqdm.refresh()
            self._tqdm.close()

