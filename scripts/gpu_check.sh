#!/usr/bin/env bash
# The one-shot check of the CUDA backend on a lent GPU machine (one H100 or H200, no network),
# run as one device command of at most 600 s:
#
#   scripts/gpu_check.sh [OUT_DIR]      (default: $OUT, else ./gpu_check_out)
#
# One global deadline (GPU_CHECK_DEADLINE_S, default 500 s) across the stages, results
# first: each stage gets what is left of it, minus a reserve for the summary and the
# grace between SIGINT and SIGKILL, and a stage without time left is recorded as skipped.
# A timed-out stage gets SIGINT (pytest still writes tests.xml), and every process it
# started, ranks in their own sessions included, is ended after it (gpu_check_lib.sh).
# Stages, in order:
#   versions  driver, GPU, nvcc, Python, jax, jaxlib, the CUDA plugin, NCCL (first)
#   build     pip install --target (no venv, no system change: PEP 668 does not apply;
#             no index, no network)
#             with nvcc and JAXCOMM_CUDA=ON; the module is copied into jaxcomm/. Without
#             nvcc, or when the build fails, a module built elsewhere for this Python by
#             scripts/build_gpu_module.sh and carried into jaxcomm/ is used.
#   loopback  MoE dispatch/combine kernels, 8 logical ranks, T=4096, H=7168, top-8, 256
#             experts, bf16, GB/s (DeepEP's byte count) against a device-to-device copy
#   decode    the same at decode size (T=128) in the low-latency layout, with and without
#             FP8 dispatch
#   jit       through jax.jit on one GPU, four collectives 4 B..1 GiB and MoE, against
#             jax.lax on the same data (tests/gpu/figures.py jit)
#   mp        4 processes sharing the GPU: dispatch+combine through CUDA IPC against a
#             device-to-device copy (tests/gpu/figures.py mp; timed without the checks,
#             which the tests stage runs)
#   tests     pytest of the GPU test files, -ra (every failure's message and traceback
#             kept), then the host-side ones (tests/gpu/test_kernel_logic.py is left to CI)
# Without a GPU every stage after versions is skipped with the reason, so that a dry run
# on a CPU machine checks the script itself.
#
# $OUT receives at most 8 files (the device tool brings back 8): check.log (everything
# printed), versions.txt, build.log, figures.log, figures.json, tests.log, tests.xml,
# summary.json. GPU_CHECK_SKIP_BUILD=1 reuses the module already in jaxcomm/ (a rerun on
# a machine still warm); GPU_CHECK_BUILD_S caps the build (default 300 s);
# GPU_CHECK_STAGES lists the stages to run (default build,loopback,decode,jit,mp,tests), e.g.
# GPU_CHECK_SKIP_BUILD=1 GPU_CHECK_STAGES=tests for a second call that only tests.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE_S:-500}
RESERVE=15  # seconds kept for the summary
OUT_DIR="${1:-${OUT:-$REPO/gpu_check_out}}"
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/jaxcomm-gpu-check.XXXXXX)
STAGES="$WORK/stages.tsv"
: > "$STAGES"
: > "$OUT_DIR/figures.log"
exec > >(tee -a "$OUT_DIR/check.log") 2>&1
TEE_PID=$!
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"

# left, record, skip, stage, sweep: the stage machinery (timeouts that keep pytest's XML,
# leftover ranks ended).
source "$REPO/scripts/gpu_check_lib.sh"
# Ranks a killed earlier run left behind would hold the GPU: end them first.
sweep "$MARKER_PREFIX-"

SELECTED=",${GPU_CHECK_STAGES:-build,loopback,decode,jit,mp,tests},"
selected() { [[ "$SELECTED" == *",$1,"* ]]; }

# -------------------------------------------------------------------------- versions
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -a)"
  echo "loadavg: $(cat /proc/loadavg)"
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: none (no nvidia-smi)"
  fi
  if command -v nvcc > /dev/null 2>&1; then echo "nvcc: $(nvcc --version | tail -n 1)"; else echo "nvcc: none"; fi
  "$PY" - <<'PYEOF' 2>&1
import importlib.metadata as md, sys
print("python:", sys.version.split()[0], sys.executable)
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "jax-cuda12-pjrt", "nvidia-nccl-cu13", "nvidia-nccl-cu12",
             "nvidia-cuda-runtime", "numpy", "nanobind", "scikit-build-core", "pytest"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
PYEOF
} > "$OUT_DIR/versions.txt"
cat "$OUT_DIR/versions.txt"
record versions 0 0 ""

GPU=${GPU_CHECK_ASSUME_GPU:-0}  # 1: run every stage without a GPU (to dry-run the plumbing)
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; then GPU=1; fi

# ----------------------------------------------------------------------------- build
EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
MODULE="jaxcomm/_jaxcomm$EXT"
: > "$OUT_DIR/build.log"
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ] || ! selected build; then
  skip build "GPU_CHECK_SKIP_BUILD=1 or not in GPU_CHECK_STAGES (module already in jaxcomm/)"
elif [ "$GPU" = 0 ] && [ "${GPU_CHECK_BUILD_WITHOUT_GPU:-0}" != 1 ]; then
  skip build "no GPU (only the GPU stages need it; GPU_CHECK_BUILD_WITHOUT_GPU=1 builds anyway)"
elif ! command -v nvcc > /dev/null 2>&1; then
  skip build "no nvcc here"
else
  PREBUILT=""
  [ -f "$MODULE" ] && PREBUILT="$WORK/prebuilt.so" && cp "$MODULE" "$PREBUILT"
  SITE="$WORK/site"
  stage build "${GPU_CHECK_BUILD_S:-300}" "$OUT_DIR/build.log" env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip install --no-index --disable-pip-version-check --no-deps --no-build-isolation \
    --no-cache-dir --target "$SITE" -v . \
    -C cmake.define.JAXCOMM_CUDA=ON -C build-dir="$WORK/build"
  built=$(ls "$SITE"/jaxcomm/_jaxcomm*.so 2> /dev/null | head -n 1)
  if [ -n "$built" ]; then
    cp "$built" "$MODULE.tmp" && mv "$MODULE.tmp" "$MODULE"
    echo "module: built here ($built)" | tee -a "$OUT_DIR/build.log"
  elif [ -n "$PREBUILT" ]; then
    cp "$PREBUILT" "$MODULE"
    echo "module: the build failed; using the prebuilt $MODULE" | tee -a "$OUT_DIR/build.log"
  fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
HAVE_MODULE=0
"$PY" -c "from jaxcomm import _jaxcomm; assert _jaxcomm.has_cuda()" > /dev/null 2>&1 && HAVE_MODULE=1
echo "module with CUDA handlers importable: $HAVE_MODULE" | tee -a "$OUT_DIR/build.log"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT_DIR/versions.txt"
try:
    from jaxcomm import _jaxcomm
    from jaxcomm._src import cuda_runtime
    path = cuda_runtime.nccl_library_path()
    if path:
        _jaxcomm.cuda_set_nccl_path(path)
    print("nccl:", _jaxcomm.cuda_nccl_version(), _jaxcomm.cuda_nccl_path())
except Exception as e:  # recorded, not fatal: only NCCL groups need it
    print("nccl: not loadable:", e)
PYEOF

WHY=""
[ "$GPU" = 1 ] || WHY="no GPU (nvidia-smi -L failed)"
[ -z "$WHY" ] && [ "$HAVE_MODULE" = 0 ] && WHY="no module with CUDA handlers (see build.log)"

# --------------------------------------------------------------------------- figures
export JAX_PLATFORMS=cuda,cpu
# figure NAME CAP CMD...: a figure stage, unless there is no GPU or it is not selected.
figure() {
  local name=$1
  if [ -n "$WHY" ]; then skip "$name" "$WHY"
  elif ! selected "$name"; then skip "$name" "not in GPU_CHECK_STAGES"
  else stage "$name" "$2" "$OUT_DIR/figures.log" "${@:3}"
  fi
}
figure loopback 60 "$PY" -m jaxcomm._src.cuda_loopback --ranks 8 --tokens 4096 --hidden 7168 \
  --topk 8 --experts 256 --dtype bfloat16 --layouts packed,padded --iters 10 --json "$WORK/loopback.json"
figure decode 30 "$PY" -m jaxcomm._src.cuda_loopback --ranks 8 --tokens 128 --hidden 7168 \
  --topk 8 --experts 256 --dtype bfloat16 --layouts low_latency --fp8 both --iters 20 --json "$WORK/decode.json"
figure jit 100 "$PY" tests/gpu/figures.py jit --json "$WORK/jit.json" --budget-s 80
figure mp 90 "$PY" tests/gpu/figures.py mp --json "$WORK/mp.json" --budget-s 75

# ----------------------------------------------------------------------------- tests
: > "$OUT_DIR/tests.log"
if [ -n "$WHY" ]; then
  skip tests "$WHY"
elif ! selected tests; then
  skip tests "not in GPU_CHECK_STAGES"
else
  # -o addopts=: without pyproject's pytest-xdist workers (one GPU; xdist may be absent).
  stage tests 400 "$OUT_DIR/tests.log" "${PYTEST[@]}" -q -ra -o addopts= -p no:cacheprovider \
    tests/gpu/test_collectives_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_moe_inference_gpu.py \
    tests/gpu/test_multiprocess_gpu.py \
    tests/gpu/test_cuda_host.py --timeout=240 --junitxml="$OUT_DIR/tests.xml" -o junit_family=xunit1
fi

# --------------------------------------------------------------------------- summary
"$PY" - "$OUT_DIR" "$WORK" "$(( $(date +%s) - T0 ))" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out, work, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3])
res = {"elapsed_s": elapsed, "stages": {}}
for line in open(os.path.join(work, "stages.tsv")):
    name, rc, secs, note = (line.rstrip("\n").split("\t") + [""])[:4]
    res["stages"][name] = {"rc": int(rc), "seconds": int(secs or 0), "note": note}
figures = {}
for name in ("loopback", "decode", "jit", "mp"):
    try:
        figures[name] = json.load(open(os.path.join(work, f"{name}.json")))
    except Exception as e:  # a skipped or failed stage leaves no file: say so
        figures[name] = {"missing": str(e)}
json.dump(figures, open(os.path.join(out, "figures.json"), "w"), indent=1)
try:
    root = ET.parse(os.path.join(out, "tests.xml")).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    res["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    res["tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:
    res["tests"] = {"missing": str(e)}
res["ok"] = all(s["rc"] == 0 for s in res["stages"].values())
json.dump(res, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(res, indent=1))
PYEOF
echo "files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
rm -rf "$WORK"
exec 1>&- 2>&-
wait "$TEE_PID" 2> /dev/null || true
