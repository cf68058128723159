"""NumPy references of jaxcomm.moe's documented semantics, shared by the MoE tests.

Every function here is plain NumPy (and ml_dtypes for the FP8 and bfloat16 formats): the
tests compare jaxcomm against these, never against jaxcomm itself.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

R = 8


def np_dispatch(xs, ids, E, capacity=None, padded=False, slab=None):
    """Returns expert_x [R, ...], sizes [R, El], row_of {(s, t, k): (d, flat row)}, dropped [R].

    padded: slabs of ``slab`` rows per expert (default R*T; the low-latency layout's is
    R*max_tokens), each expert's rows at its slab's front.
    """
    Rn, T, K = ids.shape
    El = E // Rn
    H = xs.shape[-1]
    slab = slab or Rn * T
    rows = El * slab if padded else (capacity or Rn * T * min(K, El))
    ex = np.zeros((Rn, rows, H), xs.dtype)
    sizes = np.zeros((Rn, El), np.int32)
    row_of, dropped = {}, np.zeros(Rn, np.int32)
    for d in range(Rn):
        n = 0
        for el in range(El):
            e = d * El + el
            members = [(s, t, k) for s in range(Rn) for t in range(T) for k in range(K)
                       if ids[s, t, k] == e]
            if padded:
                kept, base = members[:slab], el * slab
            else:
                kept, base = members[:max(0, rows - n)], n
            for j, (s, t, k) in enumerate(kept):
                ex[d, base + j] = xs[s, t]
                row_of[(s, t, k)] = (d, base + j)
            for (s, _, _) in members[len(kept):]:
                dropped[s] += 1
            sizes[d, el] = len(kept)
            n += len(kept)
    if padded:
        ex = ex.reshape(Rn, El, slab, H)
    return ex, sizes, row_of, dropped


def np_combine(eys, row_of, w, T, H):
    Rn = w.shape[0]
    flat = eys.reshape(Rn, -1, H)
    y = np.zeros((Rn, T, H), np.float64)
    for (s, t, k), (d, row) in row_of.items():
        y[s, t] += w[s, t, k] * flat[d, row].astype(np.float64)
    return y


def routing(T, K, E, seed, p_none=0.1, distinct=True):
    rng = np.random.default_rng(seed)
    if distinct:
        ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(R)])
    else:
        ids = rng.integers(0, E, size=(R, T, K))
    ids = ids.astype(np.int32)
    ids[rng.random(ids.shape) < p_none] = -1
    return ids


def tagged_x(T, H, seed=0):
    """Token rows carry (source rank, token index) in columns 0 and 1."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(R, T, H)).astype(np.float32)
    x[:, :, 0] = np.arange(R)[:, None]
    x[:, :, 1] = np.arange(T)[None, :]
    return x




def np_combine_f32(eys, row_of, w, T, H, dtype=np.float32):
    """The combine in the host kernels' float32 order, rounded once to ``dtype``: per token,
    each destination rank's slots summed in k order, then those partial sums in rank order."""
    Rn, _, K = w.shape
    flat = eys.reshape(Rn, -1, H).astype(np.float32)
    y = np.zeros((Rn, T, H), np.float32)
    for s in range(Rn):
        for t in range(T):
            acc = None
            for d in range(Rn):
                part = None
                for k in range(K):
                    if (s, t, k) not in row_of or row_of[(s, t, k)][0] != d:
                        continue
                    term = np.float32(w[s, t, k]) * flat[d, row_of[(s, t, k)][1]]
                    part = term if part is None else part + term
                if part is not None:
                    acc = part if acc is None else acc + part
            if acc is not None:
                y[s, t] = acc
    return y.astype(dtype)


FP8_BLOCK = 128


def np_quantize_fp8(x):
    """jaxcomm's (DeepEP's) FP8 format of tokens x [..., H]: per 128 channels, amax =
    max(max |x|, 1e-4), values e4m3fn(x * (448 / amax)), scale amax * float32(1/448), in
    float32."""
    x = np.asarray(x, np.float32)
    H = x.shape[-1]
    nb = -(-H // FP8_BLOCK)
    pad = np.zeros(x.shape[:-1] + (nb * FP8_BLOCK,), np.float32)
    pad[..., :H] = x
    blocks = pad.reshape(x.shape[:-1] + (nb, FP8_BLOCK))
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)).astype(np.float32)
    inv = (np.float32(448.0) / amax).astype(np.float32)
    q = (blocks * inv[..., None]).astype(np.float32).reshape(pad.shape)[..., :H]
    q = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, (amax * np.float32(1.0 / 448.0)).astype(np.float32)


def np_dequantize_fp8(q, scales, dtype):
    """values [..., H] times their blocks' scales, in float32, rounded to ``dtype``."""
    v = np.asarray(q).astype(np.float32)
    H = v.shape[-1]
    s = np.repeat(scales, FP8_BLOCK, axis=-1)[..., :H]
    return (v * s).astype(np.float32).astype(dtype)
