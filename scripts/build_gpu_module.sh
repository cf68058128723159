#!/usr/bin/env bash
# Builds the CUDA-enabled extension for another Python (default python3.12, the GPU
# machine's) on a machine that has nvcc, into jaxcomm/, so that a GPU session can carry
# it to a GPU machine that has no CUDA toolkit to build with (scripts/gpu_check.sh then
# uses it). That Python needs nanobind, not jax: the FFI headers come from this machine's
# jaxlib (the XLA FFI C API is stable across jaxlib versions).
#   scripts/build_gpu_module.sh [python]   -> prints the module's path under jaxcomm/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$("${1:-python3.12}" -c 'import sys; print(sys.executable)')
FFI=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
BUILD=${BUILD_DIR:-/tmp/jaxcomm-build-gpu-module}
cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PY" -DXLA_FFI_INCLUDE_DIR="$FFI" \
  -DJAXCOMM_CUDA=ON > "$BUILD.log" 2>&1 || { cat "$BUILD.log"; exit 1; }
ninja -C "$BUILD" >> "$BUILD.log" 2>&1 || { tail -n 40 "$BUILD.log"; exit 1; }
so=$(ls "$BUILD"/_jaxcomm.cpython-*.so)
cp "$so" jaxcomm/.build_gpu_module_tmp.so
mv jaxcomm/.build_gpu_module_tmp.so "jaxcomm/$(basename "$so")"
echo "jaxcomm/$(basename "$so")"
