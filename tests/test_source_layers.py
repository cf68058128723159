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
