"""jaxcomm's FP8 token format: in jax.numpy, and as the ``moe_fp8_quantize`` primitive, which
the CUDA backend serves with its own kernel (ffi/cuda/kernels.cu, one warp per 128-channel
block) and other platforms with the jax.numpy form. The host backend quantizes inside its
fused dispatch (ffi/cpu/moe_convert.h). All three compute the same bits
(core/number_formats.h).

DeepEP's format: per token, one float32 scale per block of 128 channels (the last block may
be shorter); with amax = max(max |x| over the block, 1e-4), the values are
``float8_e4m3fn(x * (448 / amax))`` and the scale ``amax * float32(1 / 448)``, so ``value * scale``
approximates x within FP8's rounding (3 mantissa bits: a relative error up to 2^-4).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm._src import primitive

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


# ------------------------------------------------------------------------ the primitive

def _quantize_avals(x):
    T, H = x.shape
    # x's sharding and varying axes carry over (rows stay where they are).
    return [x.update(shape=(T, H), dtype=jnp.dtype(jnp.float8_e4m3fn)),
            x.update(shape=(T, blocks(H)), dtype=jnp.dtype(jnp.float32))]


def _quantize_batch(vals, dims):
    (x,), (d,) = vals, dims
    x = jnp.moveaxis(x, d, 0)
    q, s = quantize_p.bind(x.reshape(-1, x.shape[-1]))
    return [q.reshape(x.shape), s.reshape(*x.shape[:-1], s.shape[-1])], [0, 0]


# The op table's local CUDA kernel where this process has the CUDA backend; jax.numpy
# (quantize) elsewhere.
quantize_p = primitive.define_local(primitive.LocalSpec(
    name="moe_fp8_quantize",
    out_avals=_quantize_avals,
    reference=quantize,
    batcher=_quantize_batch,
    multiple_results=True,
))


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize` as one kernel where the platform has one (CUDA): x [T, H] ->
    (values float8_e4m3fn [T, H], scales float32 [T, ceil(H/128)]). Not differentiable:
    the FP8 dispatches define their own derivative (straight through, moving x's tangent)
    and quantize a stop_gradient of x."""
    return tuple(quantize_p.bind(x))
