"""Importing jaxcomm from a source tree that has no compiled extension."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jaxcomm


def test_source_tree_without_extension_says_so(tmp_path):
    # A clean clone's jaxcomm/ shadows the installed package when Python starts in the
    # repository root; the error must say that, not "partially initialized module".
    src = os.path.dirname(os.path.abspath(jaxcomm.__file__))
    shutil.copytree(src, tmp_path / "jaxcomm",
                    ignore=shutil.ignore_patterns("_jaxcomm*.so", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", "import jaxcomm"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: jaxcomm's compiled extension (_jaxcomm) is missing from "
                           f"{tmp_path / 'jaxcomm'}."), proc.stderr
    assert "pip install ." in last
