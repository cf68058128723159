"""How jaxcomm's error messages read once Python shows them, and how to find the message.

The library's own knowledge of its errors' text: :func:`clean` takes the jaxcomm message
out of what JAX's asynchronous dispatch wraps around it (``init()``'s fail-fast hook
prints it); :func:`is_jaxcomm_error` and :func:`is_mismatch` tell such lines apart. The
analysis of what an error says about other processes (``jaxcomm.trace.causes``) builds
on these; the library never imports that tool.
"""

from __future__ import annotations

import re

_DISPATCH = re.compile(r"(?:(?:INTERNAL|[A-Z_]+): )?Error dispatching computation: ")
_STATUS = re.compile(r"^(?:[A-Za-z_.]+(?:Error|Exception): )?(?:[A-Z_]{4,}: )*")

#: The start of a jaxcomm error message (after any status code).
_JAXCOMM = re.compile(r"(jaxcomm[.:][^\n]*|MISMATCH:[^\n]*)")


def clean(text: str) -> str:
    """The useful part of an error as Python shows it: the jaxcomm message, without the
    ``INTERNAL: Error dispatching computation:`` prefixes JAX's asynchronous dispatch
    repeats once per computation the failed one fed, nor the exception and status names.

    Example::

        clean("ValueError: INTERNAL: Error dispatching computation: INTERNAL: Error "
              "dispatching computation: UNAVAILABLE: jaxcomm.all_reduce ...: process 3 ...")
        # 'jaxcomm.all_reduce ...: process 3 ...'
    """
    text = _DISPATCH.sub("", text.strip())
    m = _JAXCOMM.search(text)
    if m is not None:
        return m.group(1).strip()
    return _STATUS.sub("", text).strip()


def is_mismatch(error: str) -> bool:
    """Whether ``error`` is a MISMATCH error (ranks waiting in different collectives)."""
    return "MISMATCH: " in error


def is_jaxcomm_error(line: str) -> bool:
    """Whether an output line carries a jaxcomm error (the last line of a traceback)."""
    return ("jaxcomm." in line or "MISMATCH:" in line) and (
        "Error" in line or "MISMATCH:" in line or "failed" in line or "timed out" in line)
