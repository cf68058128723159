"""Issue 30, defect 6: scripts/gpu_check.sh's stages and tests/gpu/figures.py keep what
they measured when something fails or runs out of time, and leave nothing running on
the GPU. Run on CPU with fake stages through the script's own stage machinery
(scripts/gpu_check_lib.sh), and figures.py's own rows on CPU devices."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIB = ROOT / "scripts" / "gpu_check_lib.sh"


def run_stage(tmp_path: pathlib.Path, cap: int, command: str, ignore_sigint: bool = False) -> list[str]:
    """Runs `stage fake CAP LOG COMMAND` of gpu_check_lib.sh in bash; the stage's record."""
    script = textwrap.dedent(f"""\
        PY={sys.executable}
        source {LIB}
        T0=$(date +%s); DEADLINE=300; RESERVE=0; STAGES={tmp_path}/stages.tsv
        KILL_AFTER=10; MIN_STAGE_S=1
        : > "$STAGES"
        stage fake {cap} {tmp_path}/stage.log {command}
        """)
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=preexec)
    assert done.returncode == 0, done.stderr
    assert "=== fake: rc=" in done.stdout, done.stdout
    return (tmp_path / "stages.tsv").read_text().rstrip("\n").split("\t")


@pytest.mark.parametrize("ignore_sigint", [False, True])
def test_timed_out_pytest_stage_keeps_its_junit_xml(tmp_path, ignore_sigint):
    (tmp_path / "test_fake.py").write_text(textwrap.dedent("""\
        import time
        def test_fast():
            pass
        def test_slow():
            time.sleep(120)
        """))
    xml = tmp_path / "tests.xml"
    record = run_stage(tmp_path, 6, f'"${{PYTEST[@]}}" -q -p no:cacheprovider -o addopts= --rootdir={tmp_path} '
                                    f'{tmp_path}/test_fake.py --junitxml={xml}', ignore_sigint=ignore_sigint)
    assert record[0] == "fake" and record[1] == "124", record
    assert record[3] == "timed out after 6s (SIGINT)"
    cases = [c.get("name") for c in ET.parse(xml).getroot().iter("testcase")]
    assert "test_fast" in cases, cases


def test_sweep_ends_ranks_started_in_their_own_sessions(tmp_path):
    pid_file = tmp_path / "rank.pid"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(textwrap.dedent(f"""\
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(rank.pid))
        time.sleep(300)
        """))
    rank = None
    try:
        record = run_stage(tmp_path, 4, f"{sys.executable} {launcher}")
        rank = int(pid_file.read_text())
        assert record[1] in ("124", "137"), record
        deadline = time.monotonic() + 5
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), "a rank in its own session outlived the stage"
    finally:
        if rank is not None and _alive(rank):
            os.kill(rank, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_pip_in_the_build_stage_never_tries_the_network():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    pip = script[script.index("-m pip install"):].split("-C cmake.define")[0]
    assert "--no-index" in pip and "--disable-pip-version-check" in pip, pip


# --------------------------------------------------------------------------- figures

def load_figures():
    spec = importlib.util.spec_from_file_location("gpu_figures", ROOT / "tests" / "gpu" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_row_keeps_the_others_and_each_row_is_written_at_once(tmp_path, monkeypatch):
    figures = load_figures()
    out = tmp_path / "jit.json"
    seen_before: dict[str, int] = {}
    real = figures._programs

    def programs(op, mesh):
        seen_before[op] = len(json.loads(out.read_text()))
        if op == "all_gather":
            raise RuntimeError("boom")
        return real(op, mesh)

    monkeypatch.setattr(figures, "_programs", programs)
    rc = figures.main(["jit", "--platform", "cpu", "--sizes", "4", "--moe", "8,16,2,4",
                       "--json", str(out), "--budget-s", "120"])
    rows = json.loads(out.read_text())
    assert rc == 1
    assert seen_before == {"all_reduce": 0, "all_gather": 1, "all_to_all": 2, "ppermute": 3}
    assert [r.get("op", r["kind"]) for r in rows] == ["all_reduce", "all_gather", "all_to_all", "ppermute",
                                                      "moe one rank"]
    assert rows[1]["error"] == "RuntimeError: boom" and rows[1]["bytes"] == 4
    assert all(r["values_equal"] for r in rows if r.get("op") in ("all_reduce", "all_to_all", "ppermute"))
    assert rows[4]["values_close"]
