"""jaxcomm's FP8 token format in jax.numpy: for the transports other than the host backend's
(which quantizes in its kernels, ffi/cpu/moe_convert.h, with the same arithmetic).

DeepEP's format: per token, one float32 scale per block of 128 channels (the last block may
be shorter); with amax = max(max |x| over the block, 1e-4), the values are
``float8_e4m3fn(x * (448 / amax))`` and the scale ``amax * float32(1 / 448)``, so ``value * scale``
approximates x within FP8's rounding (3 mantissa bits: a relative error up to 2^-4).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BLOCK = 128
E4M3_MAX = 448.0
MIN_AMAX = 1e-4
FP8_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def blocks(H: int) -> int:
    """Scales per token of a row of H channels."""
    return -(-H // BLOCK)


def _blocked(x: jax.Array) -> jax.Array:
    """x [T, H] float32 as [T, blocks, BLOCK], the last block padded with zeros."""
    T, H = x.shape
    nb = blocks(H)
    return jnp.pad(x, ((0, 0), (0, nb * BLOCK - H))).reshape(T, nb, BLOCK)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, H] (float32, bfloat16 or float16) -> (values float8_e4m3fn [T, H], scales
    float32 [T, ceil(H/128)])."""
    T, H = x.shape
    xb = _blocked(x.astype(jnp.float32))
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), MIN_AMAX)
    q = jnp.clip(xb * (jnp.float32(E4M3_MAX) / amax)[..., None], -E4M3_MAX, E4M3_MAX)
    q = q.reshape(T, -1)[:, :H].astype(jnp.float8_e4m3fn)
    return q, amax * jnp.float32(1.0 / E4M3_MAX)


def dequantize(q: jax.Array, scales: jax.Array, dtype: Any) -> jax.Array:
    """(values [N, H], scales [N, blocks]) -> [N, H] in ``dtype``, each block times its scale."""
    N, H = q.shape
    v = _blocked(q.astype(jnp.float32)) * scales[..., None]
    return v.reshape(N, -1)[:, :H].astype(dtype)
