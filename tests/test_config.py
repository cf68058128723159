"""The configuration registry (jaxcomm/_src/config.py) is the one list of JAXCOMM_*
variables: every reader in Python and C++ goes through it or is checked against it here,
a malformed value is an error naming the variable on both sides, and
docs/configuration.md is generated from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fresh_util import Command, run_fresh
from jaxcomm._src import config, config_doc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")  # the sources the C++ readers are checked in
# Children start in tests/: from the repository root, `python -c` would import a clean
# clone's jaxcomm/ (no extension built there) instead of the installed package.
CHILD_CWD = HERE


def _sources(top: str, suffixes: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
        for f in files:
            if f.endswith(suffixes):
                path = os.path.join(dirpath, f)
                out[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    return out


def test_docs_are_generated_from_the_registry():
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == config_doc.markdown(), f"docs/configuration.md is stale: {config_doc.COMMAND}"


def test_every_python_reader_names_a_registered_variable():
    # Direct environment reads of JAXCOMM_* variables happen in config.py only; elsewhere
    # the names appear as arguments of config's functions or the launch contract's ENV_*.
    # A name is a literal or an ENV_* constant; reads are get/getenv, [] not assigned, `in`.
    name = r"""(?:["']JAXCOMM_\w+["']|\bENV_\w+)"""
    reads = re.compile(rf"""(?:environ\.get\(|\benv\.get\(|getenv\()\s*{name}"""
                       rf"""|(?:environ|\benv)\[\s*{name}\s*\](?!\s*=)"""
                       rf"""|{name}\s+(?:not\s+)?in\s+(?:os\.environ|env)\b""")
    for path, text in _sources("jaxcomm", (".py",)).items():
        assert not reads.findall(text) or path.endswith(os.path.join("_src", "config.py")), \
            (path, reads.findall(text))
    for read in ('"JAXCOMM_X" in os.environ', "env.get(ENV_JOB_ID)", "os.environ['JAXCOMM_X']",
                 "env[ENV_COORDINATOR]", "ENV_X not in env"):
        assert reads.search(read), read  # the pattern sees each form of a read
    assert not reads.search("os.environ[ENV_JOB_ID] = job_id")  # setting one is no read
    named = set()
    for text in _sources("jaxcomm", (".py",)).values():
        named |= set(re.findall(r"""config\.(?:get|raw|is_set|seconds|variable)\(\s*["'](JAXCOMM_\w+)""", text))
        named |= set(re.findall(r"""_env_seconds\(\s*["'](JAXCOMM_\w+)""", text))
        named |= set(re.findall(r"""^ENV_\w+ = ["'](JAXCOMM_\w+)["']""", text, re.M))
    assert named and named <= set(config.VARIABLES), named - set(config.VARIABLES)


def test_every_cpp_reader_matches_the_registry():
    sources = _sources("ffi", (".cc", ".h", ".cu"))
    # The emulated CUDA runtime reads CUDA's own CUDA_VISIBLE_DEVICES, as libcudart does
    # when it starts (no jaxcomm variable): that one read only.
    cuda_own = {os.path.join("ffi", "cuda_emu", "runtime", "devices.cc"): 'getenv("CUDA_VISIBLE_DEVICES")'}
    for path, text in sources.items():
        if path != os.path.join("ffi", "core", "env.cc"):
            text = text.replace(cuda_own.get(path, "\0"), "", 1)
            assert "getenv(" not in text, f"{path} reads the environment outside core/env.cc"
    env_cc = sources[os.path.join("ffi", "core", "env.cc")]
    natives = {v.name for v in config.VARIABLES.values() if v.native}
    found = set()
    for text in sources.values():
        for name, unit, default in re.findall(r'env::Count\("(\w+)", "(\w+)", ([^,]+),', text):
            v = config.variable(name)
            assert v.parse is not None and int(eval(default, {})) == int(v.default), name
            with pytest.raises(ValueError, match=f"must be a whole number of {unit}, got"):
                config.get(name, {name: "abc"})
            found.add(name)
        for name, default in re.findall(r'env::Flag\("(\w+)", (true|false),', text):
            assert config.variable(name).default == ("1" if default == "true" else "0"), name
            found.add(name)
        for name, choices in re.findall(r'env::Choice\("(\w+)", \{([^}]*)\}', text):
            assert config.variable(name).default == "", name
            for c in re.findall(r'"(\w+)"', choices):
                assert config.get(name, {name: c}) == c
            found.add(name)
        found |= set(re.findall(r'env::Text\("(\w+)"\)', text))
    found |= set(re.findall(r'getenv\("(\w+)"\)', env_cc))
    assert found == natives, (found ^ natives)


MALFORMED_NATIVE = [
    ("JAXCOMM_SPIN_US", "abc"), ("JAXCOMM_SPIN_US", "-5"), ("JAXCOMM_NONTEMPORAL_BYTES", "4MiB"),
    ("JAXCOMM_TRACE_ENTRIES", "1e3"), ("JAXCOMM_SINGLE_COPY", "yes"), ("JAXCOMM_INLINE", "2"),
    ("JAXCOMM_CPU_F16C", "on"),
]
# What the extension's loader and the Python check make of a malformed value, in a fresh
# jaxcomm: the C++ runtime reads these once, when the extension loads. (import jaxcomm
# itself validates JAXCOMM_TRACE_ENTRIES, for the flight recorder.)
_CONFIG_ERRORS = """
import sys
try:
    from jaxcomm._src import runtime
    runtime.check_configuration()
except ValueError as e:
    error = e
print(sys.modules['jaxcomm._jaxcomm'].config_errors())
print('raised:', error)
"""
_FIRST_TRACE = """
import jax, jax.numpy as jnp, jaxcomm
mesh = jax.make_mesh((1,), ('x',))
f = jax.shard_map(lambda v: jaxcomm.all_reduce(v, 'x'), mesh=mesh, in_specs=jax.P(), out_specs=jax.P())
jax.jit(f)(jnp.ones(4))
"""


@pytest.fixture(scope="module")
def fresh_runs() -> dict:
    """The commands of the tests below, each in a fresh jaxcomm (tests/fresh_util.py)."""
    return run_fresh({
        **{f"{name}={raw}": Command(code=_CONFIG_ERRORS, env={name: raw}) for name, raw in MALFORMED_NATIVE},
        "first trace": Command(code=_FIRST_TRACE, env={"JAXCOMM_SPIN_US": "abc"}),
    }, cwd=CHILD_CWD)


@pytest.mark.parametrize("name,raw", MALFORMED_NATIVE)
def test_cpp_and_python_reject_a_malformed_value_alike(fresh_runs, name, raw):
    with pytest.raises(ValueError) as python_error:
        config.get(name, {name: raw})
    assert str(python_error.value).startswith(f"{name} must be"), python_error.value
    proc = fresh_runs[f"{name}={raw}"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"[{str(python_error.value)!r}]\nraised: {python_error.value}\n", proc.stdout


def test_a_malformed_value_fails_the_first_trace(fresh_runs):
    proc = fresh_runs["first trace"]
    assert proc.returncode != 0
    assert "ValueError: JAXCOMM_SPIN_US must be a whole number of microseconds, got 'abc'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name,raw,message", [
    ("JAXCOMM_TIMEOUT_S", "soon", "JAXCOMM_TIMEOUT_S must be a number of seconds, got 'soon'"),
    ("JAXCOMM_TIMEOUT_S", "0", "JAXCOMM_TIMEOUT_S must be positive, got '0'"),
    ("JAXCOMM_BACKEND", "nccl", "JAXCOMM_BACKEND must be one of ('auto', 'jaxcomm', 'xla'), got 'nccl'"),
    ("JAXCOMM_TRANSPORT", "udp", "JAXCOMM_TRANSPORT must be one of ('auto', 'tcp', 'mpi', 'shm+tcp'), got 'udp'"),
    ("JAXCOMM_TCP_ADDRESS", "localhost", "JAXCOMM_TCP_ADDRESS must be an IPv4 address, got 'localhost'"),
    ("JAXCOMM_CUDA_ONE_RANK", "NCCL", "JAXCOMM_CUDA_ONE_RANK must be one of ('nccl',), got 'NCCL'"),
    ("JAXCOMM_HEARTBEAT_TIMEOUT_S", "-1", "JAXCOMM_HEARTBEAT_TIMEOUT_S must be positive, got '-1'"),
    ("JAXCOMM_COORDINATION_SERVICE", "inside", "JAXCOMM_COORDINATION_SERVICE must be one of ('external',), got 'inside'"),
])
def test_malformed_values_name_the_variable(name, raw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config.get(name, {name: raw})


def test_defaults_and_overrides():
    assert config.get("JAXCOMM_TIMEOUT_S", {}) == 300.0
    assert config.get("JAXCOMM_TIMEOUT_S", {"JAXCOMM_TIMEOUT_S": " 2.5 "}) == 2.5
    assert config.get("JAXCOMM_BACKEND", {"JAXCOMM_BACKEND": "XLA"}) == "xla"
    assert config.get("JAXCOMM_TCP_ADDRESS", {}) is None
    assert config.seconds("JAXCOMM_INIT_TIMEOUT_S", {"JAXCOMM_INIT_TIMEOUT_S": "0.5"}) == 1
    assert config.seconds("JAXCOMM_SHUTDOWN_TIMEOUT_S", {}) == 60
    with pytest.raises(KeyError, match="JAXCOMM_NOPE is not in jaxcomm's configuration registry"):
        config.get("JAXCOMM_NOPE")


def test_markdown_command():
    # The documented command, as the docs name it; warning-free (a runpy RuntimeWarning
    # said the module was imported before it ran as __main__).
    assert config_doc.COMMAND in open(os.path.join(ROOT, "docs", "configuration.md")).read()
    argv = config_doc.COMMAND.split(">")[0].split()[1:]
    proc = subprocess.run([sys.executable, *argv],
                          capture_output=True, text=True, timeout=120, cwd=CHILD_CWD)
    assert proc.returncode == 0 and proc.stdout == config_doc.markdown(), proc.stderr
    assert "RuntimeWarning" not in proc.stderr, proc.stderr
