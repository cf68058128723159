#!/usr/bin/env bash
# One prepared check of the CUDA backend on a machine with one NVIDIA GPU and no network.
#
# Expects Python 3.12 with jax/jaxlib 0.11 + jax-cuda13-plugin, nvidia-nccl-cu13,
# nanobind, scikit-build-core, cmake, ninja and pytest installed. Stages (each with its own
# time limit; a failed stage is recorded and the next one still runs):
#   env      GPU, driver, jax devices
#   build    pip install --no-build-isolation --no-deps . with JAXCOMM_CUDA=ON (where the
#            machine has no nvcc: a module from scripts/build_gpu_module.sh, carried in)
#   import   the extension has CUDA handlers; NCCL loads from the wheel
#   tests    pytest tests/gpu (JAX_PLATFORMS=cuda,cpu)
#   loopback 8 logical ranks, T=4096, H=7168, top-8, 256 experts, bf16, smallest capacity
#            that drops nothing, packed and padded layouts
# GPU_CHECK_SKIP_BUILD=1 skips the build (a rerun on a machine that already built).
# Writes results.json (and each stage's log) to the directory given as $1, else $OUT,
# else ./gpu_check_out. Total budget: under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-$PWD/gpu_check_out}}"
mkdir -p "$OUT_DIR"
STAGES="$OUT_DIR/stages.tsv"
: > "$STAGES"
PY="${PYTHON:-python3}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false

# stage NAME SECONDS CMD...: runs CMD with a deadline, logs to NAME.log, records rc and time.
stage() {
  local name=$1 limit=$2
  shift 2
  local t0 t1 rc
  t0=$(date +%s.%N)
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN{print $t1 - $t0}")" >> "$STAGES"
  tail -n 15 "$OUT_DIR/$name.log"
  echo "=== $name: rc=$rc"
  return 0
}

stage env 60 bash -c "nvidia-smi; $PY -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__); print(jax.devices())'"

# Build with nvcc when the machine has it; without, use a module built for this Python on
# a machine with nvcc (scripts/build_gpu_module.sh) and carried into jaxcomm/.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then  # a rerun on the same machine
  echo "skipped (GPU_CHECK_SKIP_BUILD=1)" > "$OUT_DIR/build_mode.txt"
elif command -v nvcc > /dev/null 2>&1; then
  echo "pip install with nvcc $(nvcc --version | tail -n 1)" > "$OUT_DIR/build_mode.txt"
  stage build 300 bash -c "
    $PY -m pip install --no-build-isolation --no-deps -v . -C cmake.define.JAXCOMM_CUDA=ON &&
    so=\$(cd / && $PY -c 'import jaxcomm._jaxcomm as m; print(m.__file__)') &&
    cp \"\$so\" jaxcomm/.gpu_check_tmp.so && mv jaxcomm/.gpu_check_tmp.so jaxcomm/\$(basename \"\$so\")"
elif [ -f "jaxcomm/_jaxcomm$EXT" ]; then
  echo "no nvcc: prebuilt jaxcomm/_jaxcomm$EXT" > "$OUT_DIR/build_mode.txt"
else
  echo "no nvcc and no prebuilt jaxcomm/_jaxcomm$EXT" > "$OUT_DIR/build_mode.txt"
  printf 'build\t127\t0\n' >> "$STAGES"
fi
cat "$OUT_DIR/build_mode.txt"
# Whichever way it came, the module now sits in the source tree: import from there.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

stage import 60 env JAX_PLATFORMS=cuda,cpu "$PY" -c "
import json
from jaxcomm import _jaxcomm
from jaxcomm._src import cuda_runtime
info = dict(has_cuda=_jaxcomm.has_cuda(), cuda_devices=_jaxcomm.cuda_device_count(),
            gpu_backend=cuda_runtime.gpu_backend_present(), nccl_wheel=cuda_runtime.nccl_library_path())
if info['nccl_wheel']:
    _jaxcomm.cuda_set_nccl_path(info['nccl_wheel'])
info['nccl_version'] = _jaxcomm.cuda_nccl_version()
info['nccl_loaded'] = _jaxcomm.cuda_nccl_path()
print(json.dumps(info))
json.dump(info, open('$OUT_DIR/import.json', 'w'))
assert info['has_cuda'] and info['gpu_backend'], info
"

stage tests 240 env JAX_PLATFORMS=cuda,cpu pytest -q -p no:cacheprovider tests/gpu -rs \
  --junitxml="$OUT_DIR/tests.xml" -o junit_family=xunit1

stage loopback 180 env JAX_PLATFORMS=cuda,cpu "$PY" -m jaxcomm._src.cuda_loopback \
  --ranks 8 --tokens 4096 --hidden 7168 --topk 8 --experts 256 --dtype bfloat16 \
  --layouts packed,padded --iters 10 --json "$OUT_DIR/loopback.json"

"$PY" - "$OUT_DIR" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
res = {"stages": {}}
for line in open(os.path.join(out, "stages.tsv")):
    name, rc, secs = line.rstrip("\n").split("\t")
    res["stages"][name] = {"rc": int(rc), "seconds": float(secs or 0)}
def load(name):
    p = os.path.join(out, name)
    try:
        return json.load(open(p))
    except Exception as e:  # a failed stage leaves no file: say so, keep going
        return {"missing": f"{name}: {e}"}
try:
    res["build_mode"] = open(os.path.join(out, "build_mode.txt")).read().strip()
except OSError:
    res["build_mode"] = None
res["import"] = load("import.json")
res["loopback"] = load("loopback.json")
try:
    root = ET.parse(os.path.join(out, "tests.xml")).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    res["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    res["tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:
    res["tests"] = {"missing": str(e)}
res["ok"] = all(s["rc"] == 0 for s in res["stages"].values())
json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
print(json.dumps({k: res[k] for k in ("stages", "tests", "ok")}, indent=1))
PYEOF
