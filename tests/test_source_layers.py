"""The C++ layers (docs/design.md): ``ffi/core`` is shared by both backends and includes
neither; ``ffi/cpu`` and ``ffi/cuda`` include ``core/`` and themselves, never each other.
What both backends need (an MoE slot order, a call attribute) moves to ``core/``."""

from __future__ import annotations

import os
import re

import pytest

FFI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ffi")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"/]+)/', re.M)
# The project's own directories each layer may include (third-party ones, such as xla/,
# are not checked here).
ALLOWED = {"core": {"core"}, "cpu": {"core", "cpu"}, "cuda": {"core", "cuda"}}


def _sources(layer: str) -> list[str]:
    root = os.path.join(FFI, layer)
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files
                  if f.endswith((".h", ".cc", ".cu", ".cuh")))


@pytest.mark.skipif(not os.path.isdir(FFI), reason="an installed jaxcomm without its sources")
@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_includes_only_what_it_may(layer):
    files = _sources(layer)
    assert files, layer
    own = set(ALLOWED)
    wrong = [(os.path.relpath(f, FFI), d) for f in files
             for d in INCLUDE.findall(open(f, encoding="utf-8").read())
             if d in own and d not in ALLOWED[layer]]
    assert not wrong, f"ffi/{layer} includes another layer's files: {wrong}"


PACKAGE = os.path.join(os.path.dirname(FFI), "jaxcomm")
# The library (jaxcomm/_src and the op modules) never imports jaxcomm's tools: the
# benchmarks, the launcher and the trace tools are its users (docs/design.md). Only the
# package's __init__ offers jaxcomm.trace, as a namespace.
TOOLS = re.compile(r"^\s*(?:from\s+jaxcomm(?:\.(?:bench|launch|trace))\b|from\s+jaxcomm\s+import\s+"
                   r"(?:bench|launch|trace)\b|import\s+jaxcomm\.(?:bench|launch|trace)\b)", re.M)


@pytest.mark.skipif(not os.path.isdir(FFI), reason="an installed jaxcomm without its sources")
def test_library_imports_none_of_its_tools():
    library = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(PACKAGE, "_src")) for f in files
               if f.endswith(".py")]
    library += [os.path.join(PACKAGE, f) for f in ("moe.py", "ft.py", "lax.py")]
    wrong = [os.path.relpath(f, PACKAGE) for f in library if TOOLS.search(open(f, encoding="utf-8").read())]
    assert not wrong, f"library modules import jaxcomm's tools (bench, launch, trace): {wrong}"
