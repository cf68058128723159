"""Every code block of docs/moe.md runs, in order, as one program (in a child process: the
examples set up their own meshes and arrays), and checks its own results."""

from __future__ import annotations

import os
import re
import subprocess
import sys

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "moe.md")


def code_blocks(path: str = DOC) -> list[str]:
    with open(path) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_docs_moe_examples_run():
    blocks = code_blocks()
    assert len(blocks) >= 7, "docs/moe.md lost its examples"
    script = "\n\n".join(blocks) + "\nprint('DOC EXAMPLES OK')\n"
    # tests/ as the working directory: the jaxcomm this test imported, never a source tree.
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and "DOC EXAMPLES OK" in proc.stdout, proc.stdout + proc.stderr
