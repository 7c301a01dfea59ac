"""Projections from block-quantized weights (GGUF Q4_1 / Q8_0 kept as they were stored).

A quantized weight is a dict of arrays in the torch layout [out, in], in blocks of 32
along `in`: "q" int8 [out, in/32, 32], "d" f32 [out, in/32] and, for Q4_1, "m" f32
[out, in/32]; the weight is d * q + m (Q8_0: d * q), the same f32 expression as the GGUF
import's dequantization, so the float32 kernels and these hold the same values.

Why: a one-token CPU step is bound by reading the weights (4 bytes a weight in f32).
XLA's CPU backend compiles `dot(x, dequantize(w).T)` for one row as one fused GEMV loop
that reads 1 byte a weight and never materializes the f32 matrix, faster than the f32
GEMV. With 2 or more rows the same expression becomes a loop fusion that recomputes the
weight per row, slower than f32, and dequantizing once per step then a GEMM costs more
than reading the f32 copy, so steps with more rows use the f32 kernel
(KernelConfig.cpu_quant_max_rows; measured: bench/results/log/cpu.md).
"""
from __future__ import annotations

import jax.numpy as jnp

BLOCK = 32


def dequantize(w: dict) -> jnp.ndarray:
    """[out, in] float32."""
    q = w["q"].astype(jnp.float32)
    y = w["d"][..., None] * q
    if "m" in w:
        y = y + w["m"][..., None]
    return y.reshape(q.shape[0], -1)


def quantized_dot(x: jnp.ndarray, w: dict) -> jnp.ndarray:
    """x [T, in] @ W.T -> [T, out] float32, W the quantized weight (one fused loop for T=1
    on the CPU; see the module doc)."""
    return jnp.dot(x.astype(jnp.float32), dequantize(w).T)
