"""Runs several short Python commands, each as a fresh ``python`` would, for the price of
one jax import.

    from fresh_util import Command, run_fresh

    done = run_fresh({
        "help": Command(module="jaxcomm.bench", args=["--help"]),
        "spin": Command(code="import jaxcomm; print(jaxcomm.config.get('JAXCOMM_SPIN_US'))",
                        env={"JAXCOMM_SPIN_US": "5"}),
    })
    done["help"].returncode, done["help"].stdout, done["spin"].stderr

A new Python spends 2-3 s of CPU importing jax. Here one Python imports jax (and nothing
of jaxcomm, and creates no backend), then forks a child per command, one at a time. The
child sets its environment, redirects its output, and runs the command as ``python -m
MODULE ARGS`` or ``python -c CODE ARGS`` would (as ``__main__``): it imports jaxcomm and
its extension afresh, so whatever they read from the environment at import (``JAXCOMM_*``)
they read from the command's, and a backend it creates reads its ``XLA_FLAGS``. What jax
read at its own import cannot differ: ``JAX_*`` variables are refused.

A child ends as the interpreter would: it waits for its non-daemon threads, runs its
``atexit`` functions (jaxcomm's exit dump of the flight recorder is one), then exits with
the command's status; a signal or ``os._exit`` ends it as it would end a process.

A command made with ``wait=False`` does not hold up the next one: both run at once (the
processes of a multi-process job), and the next command made with ``wait=True`` (the
default) is the last one that starts before run_fresh waits for them all.

For commands that end on their own within seconds (a crash ends only its child; a child
whose forking Python ends, or is ended by the timeout, is killed too). Each
child starts in the working directory ``cwd``: the tests' directory by default, so that a
clean clone's source tree (no extension built in place) never shadows the installed
jaxcomm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import jaxcomm

HERE = os.path.dirname(os.path.abspath(__file__))
# The jaxcomm the tests imported (installed, or a tree with its extension built in place).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxcomm.__file__)))


@dataclasses.dataclass(frozen=True)
class Command:
    """``python -m module *args`` or ``python -c code *args``, with ``env`` added to the
    session's environment (a value of None removes the variable)."""

    module: str | None = None
    code: str | None = None
    args: tuple[str, ...] | list[str] = ()
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)
    #: Whether the next command waits for this one to end (else they run at once).
    wait: bool = True

    def __post_init__(self) -> None:
        if (self.module is None) == (self.code is None):
            raise ValueError("a Command runs either a module or code")
        jax_vars = sorted(k for k in self.env if k.startswith("JAX_"))
        if jax_vars:
            raise ValueError(f"{jax_vars}: jax reads them at its import, before the fork")


_RUN_EACH = r"""
import atexit, ctypes, json, os, runpy, signal, sys, threading, traceback
import jax  # before the forks: no backend, no jaxcomm (each child imports it afresh)

commands, out_dir = json.load(sys.stdin), sys.argv[1]
done, running = {}, []
for i, (name, c) in enumerate(commands.items()):
    out, err = (os.path.join(out_dir, f"{i}.{s}") for s in ("out", "err"))
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # Killed with this Python (PR_SET_PDEATHSIG), e.g. when run_fresh times out.
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
            with open(out, "w") as o, open(err, "w") as e:
                os.dup2(o.fileno(), 1)
                os.dup2(e.fileno(), 2)
            for k, v in c["env"].items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if c["module"] is not None:
                sys.argv = [c["module"], *c["args"]]
                runpy.run_module(c["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["-c", *c["args"]]
                exec(compile(c["code"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:
            traceback.print_exc()
        finally:
            # What the interpreter does at its end (Py_FinalizeEx): join the non-daemon
            # threads, then run the atexit functions.
            try:
                threading._shutdown()
                atexit._run_exitfuncs()
            except BaseException:
                traceback.print_exc()
                code = code or 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    running.append((name, pid, out, err))
    if c["wait"] or i == len(commands) - 1:
        for name, pid, out, err in running:
            _, status = os.waitpid(pid, 0)
            with open(out) as o, open(err) as e:
                done[name] = [os.waitstatus_to_exitcode(status), o.read(), e.read()]
        running = []
print(json.dumps(done))
"""


def run_fresh(commands: dict[str, Command], *, timeout_s: float = 240,
              cwd: str = HERE) -> dict[str, subprocess.CompletedProcess]:
    """Each command's exit status (negative: the signal that ended it) and output, by name.

    Fails (AssertionError) if the forking Python itself fails, with its output.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    spec = {name: {"module": c.module, "code": c.code, "args": [str(a) for a in c.args],
                   "env": c.env, "wait": c.wait} for name, c in commands.items()}
    with tempfile.TemporaryDirectory(prefix="jaxcomm-fresh-") as out_dir:
        proc = subprocess.run([sys.executable, "-c", _RUN_EACH, out_dir], input=json.dumps(spec),
                              env=env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    assert proc.returncode == 0 and proc.stdout.strip(), (
        f"the forking Python failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    done = json.loads(proc.stdout.splitlines()[-1])
    return {name: subprocess.CompletedProcess(spec[name]["args"], code, out, err)
            for name, (code, out, err) in done.items()}
