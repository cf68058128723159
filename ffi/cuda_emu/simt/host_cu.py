"""Rewrites CUDA device code (ffi/cuda/kernels.cu) into C++ that the host compiler builds
against the SIMT layer (ffi/cuda_emu/simt/include/jaxcomm_simt.h).

Three rewrites, each on its own line so that the line numbers (and `#line`) still point
into the .cu file in compiler messages:

- ``K<<<grid, block, shared, stream>>>(args)`` -> ``::jaxcomm::simt::Launch("K", grid,
  block, shared, stream, K, args)`` (K may be a template-id such as
  ``GatherKernel<kMode, In, Out>``; its text names it in errors);
- ``extern __shared__ T name[];`` -> ``T* name = ::jaxcomm::simt::DynamicShared<T>();``;
- ``__shared__`` -> ``static thread_local`` (one block runs at a time on a worker thread).

Usage: python host_cu.py IN.cu OUT.cc
"""

from __future__ import annotations

import re
import sys

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:alignas\(\d+\)\s+)?([\w:<>, ]+?)\s+(\w+)\s*\[\s*\]\s*;")


def _kernel_start(src: str, end: int) -> int:
    """Index where the kernel expression that ends at ``end`` (exclusive) begins."""
    i = end
    if src[i - 1] == ">":  # a template-id: match the angle brackets backwards
        depth = 0
        while True:
            i -= 1
            c = src[i]
            if c == ">":
                depth += 1
            elif c == "<":
                depth -= 1
                if depth == 0:
                    break
    while i > 0 and (src[i - 1].isalnum() or src[i - 1] in "_:"):
        i -= 1
    return i


def rewrite(src: str) -> str:
    src = _EXTERN_SHARED.sub(lambda m: f"{m.group(1)}* {m.group(2)} = ::jaxcomm::simt::DynamicShared<{m.group(1)}>();", src)
    src = src.replace("__shared__", "static thread_local")
    out = []
    pos = 0
    while True:
        start = src.find("<<<", pos)
        if start < 0:
            out.append(src[pos:])
            break
        stop = src.index(">>>", start)
        paren = stop + 3
        while src[paren].isspace():
            paren += 1
        if src[paren] != "(":
            raise SystemExit(f"host_cu.py: no argument list after a launch at offset {start}")
        k0 = _kernel_start(src, start)
        kernel = src[k0:start]
        config = src[start + 3:stop]
        out.append(src[pos:k0])
        name = " ".join(kernel.split())
        out.append(f'::jaxcomm::simt::Launch("{name}", {config}, {kernel}, ')
        pos = paren + 1
    return "".join(out)


def main() -> None:
    src_path, out_path = sys.argv[1], sys.argv[2]
    with open(src_path) as f:
        src = f.read()
    text = f'#include <jaxcomm_simt.h>\n#line 1 "{src_path}"\n' + rewrite(src)
    try:
        with open(out_path) as f:
            if f.read() == text:
                return  # unchanged: keep the timestamp, nothing to recompile
    except FileNotFoundError:
        pass
    with open(out_path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
