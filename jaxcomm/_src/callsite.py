"""The user's source location of a collective, carried into every error message."""

from __future__ import annotations

import os
import sys

_JAXCOMM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX_DIR = os.path.dirname(os.path.abspath(__import__("jax").__file__))


def user_call_site() -> str:
    """``file.py:line (function)`` of the innermost frame outside jaxcomm and jax."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_JAXCOMM_DIR) or path.startswith(_JAX_DIR)):
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown>"
