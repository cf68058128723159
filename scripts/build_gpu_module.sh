#!/usr/bin/env bash
# Builds the CUDA-enabled extension for another Python (default: python3.12, the GPU
# machine's) on a machine that has nvcc, into jaxcomm/, so that a GPU session can carry
# it (the device tool's `carry`) to a GPU machine whose build fails or that has no nvcc;
# scripts/gpu_check.sh then uses it. The target Python needs its headers only: the XLA FFI
# headers come from this machine's jaxlib (the FFI C API is stable across jaxlib
# versions) and nanobind from this machine's Python.
#   scripts/build_gpu_module.sh [python]   -> prints the module's path under jaxcomm/
# A module built here may still fail to load there (another libstdc++); the check then
# says so in build.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$("${1:-python3.12}" -c 'import sys; print(sys.executable)')
HOST_PY=${HOST_PYTHON:-python3}
FFI=$("$HOST_PY" -c "import jax.ffi; print(jax.ffi.include_dir())")
NB=$("$HOST_PY" -m nanobind --cmake_dir)
BUILD=${BUILD_DIR:-/tmp/jaxcomm-build-gpu-module}
cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PY" -DXLA_FFI_INCLUDE_DIR="$FFI" \
  -Dnanobind_ROOT="$NB" -DJAXCOMM_CUDA=ON -DCMAKE_BUILD_TYPE=Release > "$BUILD.log" 2>&1 \
  || { cat "$BUILD.log"; exit 1; }
ninja -C "$BUILD" >> "$BUILD.log" 2>&1 || { tail -n 40 "$BUILD.log"; exit 1; }
so=$(ls "$BUILD"/_jaxcomm.cpython-*.so)
cp "$so" jaxcomm/.build_gpu_module_tmp.so
mv jaxcomm/.build_gpu_module_tmp.so "jaxcomm/$(basename "$so")"
echo "jaxcomm/$(basename "$so")"
