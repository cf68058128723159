"""Reproduces the 2 x 2 emulated hang of docs/cuda.md ("What that hang is").

check_ops.py's cases of a mesh and axis in one program (as tests/multiprocess/check_ops.py
runs them, unsplit), a job of 2 processes x 2 devices on distinct emulated GPUs, with short
deadlines. Racy: about half the runs of ``all3`` hang (the others end with jaxcomm's
deadline error). Each process registers faulthandler on SIGUSR1 and prints its PID; take
stacks with ``gdb -p PID -batch -ex 'thread apply all bt'``.

    cd tests && OUTER=120 python ../scripts/emulated_mixed_hang.py all3   # or checkall, pl
"""
import os, sys, pathlib, time
_TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(_TESTS))
sys.path.insert(0, str(_TESTS / "emulation"))
import test_emulated_multiprocess as t
from mp_util import PROLOGUE, run_script

mode = sys.argv[1] if len(sys.argv) > 1 else "checkall"
body = t.VISIBLE + PROLOGUE + """
import faulthandler, signal
faulthandler.register(signal.SIGUSR1, all_threads=True)
print("PID", os.getpid(), flush=True)
""" + t.CHECK_LIB + """
devices = np.asarray(jax.devices()).reshape(NPROC, LOCAL)
mesh2 = jax.sharding.Mesh(devices, ("p", "l"))
""" + ({"checkall": 'check_all(mesh2, ("p",), "p", moe=())\n',
        "pl": 'check_all(mesh2, ("p", "l"), "pl", moe=())\n',
        "all3": 'check_all(mesh2, ("p",), "p", moe=("packed",))\ncheck_all(mesh2, ("l",), "l", moe=())\ncheck_all(mesh2, ("p", "l"), "pl", moe=("padded",))\n'}[mode]) + 'print("ALL CHECKED", flush=True)\n'
t0 = time.time()
res = run_script(body, 2, 2, prologue=False, args=["distinct", "full"],
                 env={"JAXCOMM_EMULATE_CUDA": "1", "JAXCOMM_TIMEOUT_S": "5",
                      "JAXCOMM_NCCL_MOCK_TIMEOUT_S": "8"},
                 timeout_s=float(os.environ.get("OUTER", "120")))
print("rc", res.returncode, "took", time.time() - t0)
print(res.format()[-20000:])
