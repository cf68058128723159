"""Runs one of this checkout's examples (examples/*.py) the way a user would, with the
jaxcomm this test imported (installed or built), and reads its training log.

    from example_util import run_example

    stdout, losses = run_example("moe_layer.py", "--steps", "2")
"""

from __future__ import annotations

import os
import subprocess
import sys

import jaxcomm

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run_example(name: str, *args: str, timeout_s: float = 120) -> tuple[str, list[float]]:
    """(stdout, the loss of each ``step ... loss X`` line) of ``examples/<name> ARGS``; fails
    with the output if it exits with an error. It runs from tests/, so that the source
    tree's jaxcomm (without its compiled extension) is not the one imported."""
    site = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", name), *args], env=env,
                          capture_output=True, text=True, timeout=timeout_s, cwd=HERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(line.split("loss")[1].split()[0]) for line in proc.stdout.splitlines()
              if line.startswith("step")]
    return proc.stdout, losses
