"""The benchmark's method (jaxcomm.bench.method) and its multi-process driver.

The driver must run without mpi4jax (it is optional): the end-to-end cases here use the
test environment's Python, where mpi4py and mpi4jax need not be installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import pytest

import jaxcomm
from fresh_util import Command, run_fresh
from jaxcomm.bench import method, multiprocess, report

HERE = os.path.dirname(os.path.abspath(__file__))
# The jaxcomm this test imported (installed, or a tree with its extension built in place):
# a clean clone's source tree has no extension and must not shadow the installed package.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))


# ----------------------------------------------------------------------------- method

def test_fit_recovers_the_fixed_and_per_collective_costs():
    # t(n) = 250 + 1.5 n, with one disturbed round per length: medians ignore it.
    a, b = 250.0, 1.5
    samples = {n: [a + b * n, a + b * n + 0.2, a + b * n - 0.2, 50 * (a + b * n)]
               for n in (1, 10, 100, 1000)}
    f = method.fit(samples)
    assert f.per_call_us == pytest.approx(a, abs=0.5)
    assert f.per_collective_us == pytest.approx(b, abs=1e-3)
    assert sorted(f.medians_us) == [1, 10, 100, 1000]


def test_fit_of_one_length_is_its_time_per_collective():
    f = method.fit({10: [30.0, 20.0, 40.0]})
    assert (f.per_call_us, f.per_collective_us) == (0.0, 3.0)


def test_fit_refuses_no_samples():
    with pytest.raises(ValueError, match="no samples"):
        method.fit({1: [], 10: []})


def test_large_messages_keep_the_two_shortest_lengths():
    assert method.lengths_for(4) == (1, 10, 100, 1000)
    assert method.lengths_for(1 << 20) == (1, 10, 100)
    assert method.lengths_for(16 << 20) == (1, 10)
    assert method.lengths_for(1 << 30, [1000, 1, 10]) == (1, 10)
    with pytest.raises(ValueError, match="positive"):
        method.lengths_for(4, [0, 10])


def test_sides_take_turns_in_alternating_order():
    assert [method.turn_order("ABC", r) for r in range(3)] == [
        ["A", "B", "C"], ["C", "B", "A"], ["A", "B", "C"]]


def test_summary_names_every_case_where_jaxcomm_is_behind():
    rows = [
        {"op": "all_reduce", "bytes": 4, "jaxcomm_per_collective_us": 2.0,
         "mpi4jax_per_collective_us": 1.0, "jaxcomm_per_call_us": 10.0, "mpi4jax_per_call_us": 300.0},
        {"op": "all_to_all", "bytes": 1 << 20, "jaxcomm_per_collective_us": 100.0,
         "mpi4jax_per_collective_us": 400.0, "jaxcomm_per_call_us": 12.0, "mpi4jax_per_call_us": 280.0},
        {"op": "ppermute", "bytes": 1 << 20, "jaxcomm_per_collective_us": 50.0,
         "mpi4jax_per_collective_us": None, "jaxcomm_per_call_us": 11.0, "mpi4jax_per_call_us": None},
    ]
    line = method.summary_line("mpi4jax", rows)
    assert line.startswith("vs mpi4jax: jaxcomm faster per collective in 1 of 2 cases (up to 4.00x, "
                           "all_to_all 1MiB)")
    assert "behind in all_reduce 4B 0.50x" in line
    assert "not measured: ppermute 1MiB" in line
    assert "jaxcomm 11.0 us, mpi4jax 290.0 us" in line


def test_table_states_placement_and_load():
    rec = {"op": "all_reduce", "bytes": 4, "lengths": [1, 10], "processes": 2, "devices": 2,
           "dtype": "float32", "bind": "cores", "error": None, "match": {"gloo": True},
           "started_by": "mpirun -n 2 --bind-to core", "load_after": "1.00 2.00 3.00",
           "sides": {"jaxcomm": {}, "gloo": {}},
           "jaxcomm_per_collective_us": 2.0, "gloo_per_collective_us": 200.0,
           "jaxcomm_per_call_us": 9.0, "gloo_per_call_us": 50.0,
           "jaxcomm_best_per_collective_us": 1.0, "gloo_best_per_collective_us": 150.0}
    text = report.format_table([rec])
    assert "bound: a core (share of the cores) per process (mpirun -n 2 --bind-to core)" in text
    assert "load average 1.00 2.00 3.00" in text
    row = text.splitlines()[-1].split()
    assert row[:5] == ["4B", "1,10", "2.00", "200.00", "100.00"]
    assert row[-2:] == ["150.00", "yes"]  # the ratio through the fastest calls, the check


def test_saved_records_are_fitted_again_from_their_medians(tmp_path):
    rec = {"op": "ppermute", "bytes": 1 << 20, "lengths": [1, 10, 100], "error": None, "match": {},
           "sides": {"jaxcomm": {"medians_us": {"1": 12.0, "10": 30.0, "100": 210.0},
                                 "fastest_us": {"1": 11.0, "10": 20.0, "100": 110.0}}}}
    path = str(tmp_path / "r.json")
    report.write_json([rec], path)
    (back,) = report.read_json(path)
    assert back["jaxcomm_per_collective_us"] == pytest.approx(2.0)
    assert back["jaxcomm_per_call_us"] == pytest.approx(10.0)
    assert back["jaxcomm_best_per_collective_us"] == pytest.approx(1.0)


def test_sizes_below_an_ops_smallest_are_rounded_up_and_said_so():
    # 4B of float32 is one element: too few for 8 devices' blocks (all_gather,
    # reduce_scatter, all_to_all), enough for all_reduce. Every case asked for is measured
    # or named: none dropped without a word.
    from jaxcomm.bench import collectives
    notes: list[str] = []
    cases = collectives.plan(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"],
                             [4, 16, 64], 8, 4, notes)
    assert cases == [("all_reduce", 4, 1), ("all_reduce", 16, 4), ("all_reduce", 64, 16)] + [
        (op, b, b // 4) for op in ("all_gather", "reduce_scatter", "all_to_all") for b in (32, 64)]
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert (f"{op} 4B: measured at 32B, its smallest size (one element of 4 B per device, "
                f"8 devices)") in notes, notes
        assert f"{op} 16B: the same case as 4B after rounding (32B), measured once" in notes, notes
    assert len(notes) == 6, notes
    # Nothing to say when every size fits.
    quiet: list[str] = []
    collectives.plan(["all_gather"], [32, 64], 8, 4, quiet)
    assert quiet == []


# ----------------------------------------------------------------------- measuring

def test_a_side_with_a_wrong_result_is_flagged_and_a_failing_one_dropped():
    import numpy as np
    from jaxcomm.bench import measure

    def side(f):
        return measure.Side(f, np.arange(4.0), lambda m: m, lambda out: out)

    def broken(x, steps):
        raise RuntimeError("no such collective")
    calls = []
    sides = {"jaxcomm": side(lambda x, steps: calls.append(steps) or x * 2),
             "right": side(lambda x, steps: x * 2), "wrong": side(lambda x, steps: x * 3),
             "broken": side(broken)}
    rec = measure.measure(sides, [1, 10], rounds=3, warmup=1, sync=measure.LocalSync(),
                          compare=lambda a, b: bool(np.array_equal(a, b)))
    assert rec["match"] == {"right": True, "wrong": False}
    assert sorted(rec["sides"]) == ["jaxcomm", "right", "wrong"]
    assert rec["error"] == "broken: RuntimeError: no such collective"
    # The first call, a warmup call per length, then every length once per round.
    assert calls == [1, 1, 10] + [1, 10] * 3
    assert report.failed([rec])


def test_one_process_measures_jaxcomm_xla_and_a_plain_jit_alike():
    # The suite's 8 emulated CPU devices (conftest), a mesh of 4 of them; every op.
    from jaxcomm.bench import collectives
    records = collectives.run(collectives.ALL_OPS, "64B", devices=4, rounds=2, warmup=0,
                              lengths=(1, 3))
    assert [(r["op"], r["bytes"], r["processes"], r["devices"]) for r in records] == [
        (op, 64, 1, 4) for op in collectives.ALL_OPS]
    for r in records:
        # XLA's result equals jaxcomm's after a loop of each op fed back into itself.
        assert r["error"] is None and r["match"] == {"xla": True}, r
        assert sorted(r["sides"]) == ["jaxcomm", "plain", "xla"] and r["lengths"] == [1, 3]
        for side in r["sides"].values():
            assert all(t > 0 for t in side["medians_us"].values()), r
        assert sum(r["jaxcomm_rounds"].values()) > 0, r  # jaxcomm's own rounds ran
    text = "\n".join(report.report_lines(records))
    assert "one process: the scheduler places its threads" in text
    assert "vs xla: jaxcomm faster per collective in" in text
    # The project's own targets are its check, printed only when asked (--targets).
    assert " target " not in text
    checked = "\n".join(report.report_lines(records, targets=True))
    assert "[one process] target met: " in checked or "[one process] target MISSED: " in checked


def test_combine_ratio_line_alternates_its_blocks_and_states_their_spread(monkeypatch, capsys):
    """The bfloat16/float32 combine line takes RATIO_ROUNDS alternated blocks whatever
    --iters says, its quartiles bracket the blocks' ratios, and it counts each side's page
    faults over every call it made."""
    from jaxcomm.bench import moe
    seen, counted = [], []

    def spy(jc, base, per_block, rounds):
        blocks = real(jc, base, per_block, rounds)
        seen.append(blocks)
        counted.append((jc, base))
        return blocks

    real = moe._pair_blocks
    monkeypatch.setattr(moe, "_pair_blocks", spy)
    moe._print_combine_ratios(moe._parse(["--tokens", "8", "--hidden", "64", "--topk", "2", "--experts", "8",
                                          "--devices", "4", "--dtype", "float32,bfloat16", "--iters", "1"]))
    line = capsys.readouterr().out.strip()
    [blocks] = seen
    assert len(blocks) == moe.RATIO_ROUNDS
    assert all(len(h) == len(f) == moe.RATIO_PER_BLOCK for h, f in blocks)
    m = re.fullmatch(r"combine bfloat16 vs float32, alternated in one run: ([\d.]+) ms vs ([\d.]+) ms = "
                     r"([\d.]+)x \(blocks ([\d.]+)-([\d.]+)x, 10 of 4 calls a side\); "
                     r"page faults per call (\d+) vs (\d+); load average .+", line)
    assert m, line
    th = statistics.median(t for h, _ in blocks for t in h)
    tf = statistics.median(t for _, f in blocks for t in f)
    assert m.group(1, 2, 3) == (f"{th * 1e3:.2f}", f"{tf * 1e3:.2f}", f"{th / tf:.2f}")
    q1, q3 = float(m.group(4)), float(m.group(5))
    block_ratios = sorted(statistics.median(h) / statistics.median(f) for h, f in blocks)
    assert block_ratios[0] - 0.006 <= q1 <= q3 <= block_ratios[-1] + 0.006  # printed to two places
    # Each side's calls: RATIO_ROUNDS blocks of an untimed call and RATIO_PER_BLOCK timed ones.
    [(half, f32)] = counted
    assert half.calls == f32.calls == moe.RATIO_ROUNDS * (moe.RATIO_PER_BLOCK + 1)
    assert (m.group(6), m.group(7)) == (f"{half.per_call():.0f}", f"{f32.per_call():.0f}")


def test_moe_pairs_time_after_the_warmup_and_count_faults_per_counted_call():
    """_time_pair makes `warmup` untimed, uncounted calls of each side first, then times
    both sides in alternated blocks; each row prints both sides' page faults per call."""
    import jax.numpy as jnp
    from jaxcomm.bench import moe
    calls = {"jc": 0, "base": 0}

    def side(name):
        def call():
            calls[name] += 1
            return jnp.zeros(4) + calls[name]
        return call

    pair = moe._time_pair(side("jc"), side("base"), iters=4, warmup=3)
    # 3 warm-up calls, then 2 rounds of an untimed call and 2 timed ones, for each side.
    assert calls == {"jc": 3 + 2 * 3, "base": 3 + 2 * 3}
    assert pair.tj > 0 and pair.tb > 0 and pair.faults_j >= 0 and pair.faults_b >= 0
    row = moe._Row("dispatch", moe._Pair(0.002, 0.01, 12.4, 3456.0), moved=2e6).format()
    assert row.split() == ["dispatch", "2.00", "1.00", "10.00", "0.20", "5.00x", "12/3456"], row
    assert moe.HEADER.split()[-1] == "faults/call"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_combine_rows_bench_builds_and_runs(tmp_path):
    """scripts/combine_rows_bench.cc (docs/benchmarks.md) builds against the kernels as they
    are and times both dtypes, each beside its loads alone, with the results in ordinary
    or streaming stores as STREAM_FROM says."""
    repo = os.path.dirname(HERE)
    exe = tmp_path / "crb"
    subprocess.run(["g++", "-O1", "-std=c++17", "-ffp-contract=off", "-I", os.path.join(repo, "ffi"),
                    "-pthread", os.path.join(repo, "scripts", "combine_rows_bench.cc"), "-o", str(exe)],
                   check=True, capture_output=True, timeout=240)
    number = r"[\d.]+"
    line = (rf"T=4 H=100 E=16, 2 threads, streaming stores \(STREAM_FROM={{from_}}\): bfloat16 {{bf16}}, "
            rf"float32 {{f32}}\nbfloat16 {number} ms, float32 {number} ms, ratio {number}\n"
            rf"rows read, GB/s: bfloat16 {number} \(loads alone {number}, \d+%\), "
            rf"float32 {number} \(loads alone {number}, \d+%\)\n")
    # A rank's results: 800 B of bfloat16, 1600 B of float32.
    for from_, bf16, f32 in [("4194304", "no", "no"), ("1000", "no", "yes"), ("1", "yes", "yes")]:
        env = dict(os.environ, T="4", H="100", E="16", N="3")
        env.pop("STREAM_FROM", None)  # the default first
        if from_ != "4194304":
            env["STREAM_FROM"] = from_
        out = subprocess.run([str(exe)], env=env, check=True, capture_output=True, text=True, timeout=60).stdout
        assert re.fullmatch(line.format(from_=from_, bf16=bf16, f32=f32), out), out


# ------------------------------------------------------------------------ command line

def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", JAXCOMM_TIMEOUT_S="20")
    return subprocess.run([sys.executable, "-m", "jaxcomm.bench", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)


BENCH_MODULES = ["collectives", "multiprocess", "mpi4jax_compare", "moe", "dropin", "faults",
                 "docs", "instructions", "startup", "tp"]

# The commands that only parse their arguments (help, refusals), run as a user types
# them (`python -m ...`); in one forking Python (fresh_util), not twelve new ones.
COMMANDS = {
    "--help": Command(module="jaxcomm.bench", args=["--help"]),
    "--processes 2 --help": Command(module="jaxcomm.bench", args=["--processes", "2", "--help"]),
    **{f"--processes 2 --hosts {h}": Command(module="jaxcomm.bench",
                                             args=["--processes", "2", "--hosts", h])
       for h in ("0", "3")},
    **{f"{m} --help": Command(module=f"jaxcomm.bench.{m}", args=["--help"]) for m in BENCH_MODULES},
}


@pytest.fixture(scope="module")
def commands() -> dict[str, subprocess.CompletedProcess]:
    """Each of COMMANDS' exit status and output."""
    return run_fresh(COMMANDS)


def test_help_lists_every_option(commands):
    proc = commands["--processes 2 --help"]
    assert proc.returncode == 0, proc.stderr
    for option in ("--processes", "--devices", "--hosts", "--ops", "--sizes", "--latency",
                   "--lengths", "--rounds", "--warmup", "--bind", "--no-mpi4jax", "--no-gloo", "--dtype",
                   "--timeout", "--hugetlb", "--json", "--no-check", "--no-progress", "--grace", "--targets"):
        assert option in proc.stdout, option
    assert "--worker" not in proc.stdout and "--emit-json" not in proc.stdout


# Every entry point of the benchmarks: (argv of python -m jaxcomm.bench, options its
# --help must list).
ENTRY_POINTS = {
    "one process": ([], ["--devices", "--sizes", "--lengths", "--rounds", "--hugetlb", "--plot"]),
    "processes": (["--processes", "2"], ["--processes", "--hosts", "--bind", "--no-mpi4jax"]),
    "collectives": (["collectives"], ["--processes", "--ops"]),
    "moe": (["moe"], ["--tokens", "--hidden", "--topk", "--experts", "--devices", "--iters"]),
    "docs": (["docs"], ["--out", "--quick", "--only", "--list"]),
    "startup": (["startup"], ["--processes", "--mesh", "--sides", "--transport", "--repeat", "--json"]),
    "instructions": (["instructions"], ["--op", "--size", "--length", "--calls"]),
    "tp": (["tp"], ["--devices", "--tp", "--tokens", "--decode-tokens", "--processes", "--timeline", "--json"]),
    "dropin": (["dropin"], ["--devices", "--width", "--layers", "--batch", "--steps", "--reps"]),
    "faults": (["faults"], ["--repeats", "--deadline", "--transport", "--overhead-rounds",
                            "--skip-detection", "--skip-overhead"]),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_has_a_help(entry, capsys):
    from jaxcomm.bench import __main__ as bench_main
    argv, listed = ENTRY_POINTS[entry]
    with pytest.raises(SystemExit) as exc:
        bench_main.main([*argv, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m jaxcomm.bench"), out
    for option in ["--help", *listed]:
        assert option in out, (entry, option)


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_every_benchmark_module_runs_with_help(commands, module):
    # python -m jaxcomm.bench.<module> --help, as a user would type it.
    proc = commands[f"{module} --help"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m jaxcomm.bench") and "--help" in proc.stdout, proc.stdout


def test_help_names_every_sub_benchmark(commands):
    proc = commands["--help"]
    assert proc.returncode == 0, proc.stderr
    from jaxcomm.bench import options
    assert set(options.SUBCOMMANDS) >= {"moe", "dropin", "faults", "docs", "instructions"}
    for name in options.SUBCOMMANDS:
        assert f"\n  {name} " in proc.stdout, name
        assert name in ENTRY_POINTS, name  # and its --help is tested above


@pytest.mark.parametrize("hosts", ["0", "3"])
def test_more_hosts_than_processes_is_refused(commands, hosts):
    proc = commands[f"--processes 2 --hosts {hosts}"]
    assert proc.returncode == 2
    assert f"need 1 <= --hosts <= --processes, got {hosts}" in proc.stderr


def test_mpi4jax_comparison_is_skipped_without_mpi4jax(monkeypatch, capsys):
    from jaxcomm.bench import mpi4jax_compare
    monkeypatch.setattr(multiprocess.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(multiprocess.shutil, "which", lambda name: "/usr/bin/mpirun")
    assert mpi4jax_compare.main(["--processes", "2"]) == 0
    assert "mpi4jax comparison skipped: mpi4py is not installed" in capsys.readouterr().out


def test_driver_measures_every_side_by_the_method(tmp_path):
    # jaxcomm against gloo and a plain jit, without mpi4jax, one placement.
    out = tmp_path / "records.json"
    proc = _run("--processes", "2", "--no-mpi4jax", "--ops", "all_reduce,all_to_all",
                "--sizes", "16B,256KiB", "--lengths", "1,10", "--rounds", "2", "--bind", "none",
                "--no-progress", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())
    assert [(r["op"], r["bytes"]) for r in records] == [
        ("all_reduce", 16), ("all_reduce", 256 << 10), ("all_to_all", 16), ("all_to_all", 256 << 10)]
    for r in records:
        assert r["error"] is None and r["match"] == {"gloo": True}, r
        assert r["processes"] == 2 and r["bind"] == "none" and r["lengths"] == [1, 10]
        assert sorted(r["sides"]) == ["gloo", "jaxcomm", "plain"]
        for side in r["sides"].values():
            assert all(t > 0 for t in side["medians_us"].values()), r
            # a + b*n passes through both medians (two points).
            m1, m10 = side["medians_us"]["1"], side["medians_us"]["10"]
            assert side["per_call_us"] + side["per_collective_us"] == pytest.approx(m1)
            assert side["per_call_us"] + 10 * side["per_collective_us"] == pytest.approx(m10)
    assert "not bound: the scheduler places the processes (python -m jaxcomm.launch -n 2 --bind none)" \
        in proc.stdout
    assert "load average" in proc.stdout
    assert "vs gloo: jaxcomm faster per collective in" in proc.stdout
    assert "fixed cost per call (median over cases): jaxcomm" in proc.stdout


def test_driver_plays_hosts(tmp_path):
    # 4 processes as 2 hosts: shared memory within, TCP across, all_reduce in phases.
    out = tmp_path / "records.json"
    # --no-mpi4jax: under the launcher, wherever mpi4jax is installed too (with it, the
    # driver runs mpirun jobs, one per transport between the hosts).
    proc = _run("--processes", "4", "--hosts", "2", "--ops", "all_reduce", "--sizes", "16B,1MiB",
                "--lengths", "1,10", "--rounds", "1", "--bind", "none", "--no-progress",
                "--no-mpi4jax", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())
    assert [(r["op"], r["bytes"], r["hosts"]) for r in records] == [
        ("all_reduce", 16, 2), ("all_reduce", 1 << 20, 2)]
    for r in records:
        assert r["error"] is None and r["match"] == {"gloo": True}, r


@pytest.mark.parametrize("quick", [False, True])
def test_docs_tables_are_commands_their_benchmark_accepts(quick, tmp_path):
    # Every table `python -m jaxcomm.bench docs` runs parses with its benchmark's own
    # options (a renamed option would otherwise fail only in a long docs run); only the
    # collectives tables write records.
    from jaxcomm.bench import docs, moe, options
    assert {"moe-decode", "moe-training"} <= {t.name for t in docs.TABLES}
    for table in docs.TABLES:
        argv = docs.command(table, quick, str(tmp_path))[3:]
        if table.records:
            args = options.parse(argv)
            assert args.json == str(tmp_path / f"{table.name}.json") and not args.progress
            assert args.rounds == (3 if quick else 10), table.name
        else:
            assert argv[0] == "moe" and "--json" not in argv, argv
            args = moe._parse(argv[1:])
            assert (args.iters, args.warmup) == ((2, 1) if quick else (5, 3)), table.name


def _record(op: str, nbytes: int, ours: float, theirs: float) -> dict:
    return {"op": op, "bytes": nbytes, "devices": 8, "processes": 1, "dtype": "float32",
            "bind": "process", "hosts": 1, "hugetlb": False, "error": None, "match": {"xla": True},
            "sides": {"jaxcomm": {}, "xla": {}, "plain": {}}, "jaxcomm_per_collective_us": ours,
            "xla_per_collective_us": theirs, "plain_per_collective_us": 1.0}


def test_plot_panels_have_labelled_ticks_and_room_around_their_points():
    pytest.importorskip("matplotlib")
    import math
    # Many sizes for all_reduce; one size for the others, 1.3x apart (a one-point panel on
    # log axes had no tick labels, and its points sat on the panel's edges).
    records = [_record("all_reduce", n, us, us * 10) for n, us in
               [(4, 12.0), (4096, 14.0), (1 << 20, 180.0), (16 << 20, 2600.0)]]
    records += [_record(op, 1 << 20, 150.0, 195.0) for op in ("all_gather", "reduce_scatter", "all_to_all")]
    fig = report.figure(records)
    fig.canvas.draw()
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]

    def labelled(ticks, labels, lo, hi):
        return [t.get_text() for v, t in zip(ticks, labels) if lo <= v <= hi and t.get_text()]

    for ax in panels:
        (xlo, xhi), (ylo, yhi) = ax.get_xlim(), ax.get_ylim()
        assert len(labelled(ax.get_xticks(), ax.get_xticklabels(), xlo, xhi)) >= 2, ax.get_title()
        assert len(labelled(ax.get_yticks(), ax.get_yticklabels(), ylo, yhi)) >= 2, ax.get_title()
        # A decade at least, and every point away from the edges (in log space).
        assert yhi / ylo >= 10, (ax.get_title(), ylo, yhi)
        for line in ax.get_lines():
            for x, y in zip(line.get_xdata(), line.get_ydata()):
                fx = math.log(x / xlo) / math.log(xhi / xlo)
                fy = math.log(y / ylo) / math.log(yhi / ylo)
                assert 0.05 <= fx <= 0.95 and 0.05 <= fy <= 0.95, (ax.get_title(), x, y, fx, fy)
    # The title says what is plotted and for whom; the legend names each side.
    assert fig.get_suptitle().startswith("Bus bandwidth per collective"), fig.get_suptitle()
    assert "one process, 8 devices, float32" in fig.get_suptitle().replace("\n", " ")
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["jaxcomm", "XLA's own (jax.lax, one process)"]
