"""FP8 (e4m3) weights and activations for the dense projections: W8A8 GEMMs.

A quantized projection keeps, in the torch layout that FP8 checkpoints use and that
cuBLASLt's FP8 GEMM wants (both operands K-major, "TN"):
    weight        float8_e4m3fn [out, in]
    weight_scale  float32 [out]      per output channel (a per-tensor scale is broadcast)
    input_scale   float32 []         only for static activation scales (a checkpoint's)
and computes  y = (x8 @ weight.T) * sx * weight_scale  with x8 = x / sx in e4m3, where sx
is each token's absmax / 448 (dynamic, per token) or the static input_scale. The GEMM
contracts FP8 operands with f32 accumulation and writes the model dtype; the two scale
vectors are applied after it, an elementwise op XLA fuses into the consumer (the residual
add, SiLU x up, the q/k/v reshape) rather than a pass of its own.

`fp8_linear` is the whole projection, `reference_linear` the same function dequantized
to float32 (what the tests compare with).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0          # the largest finite e4m3fn value
_MIN_SCALE = 1e-12       # an all-zero row or channel gets this scale, not a division by 0

# The projections a quantized model keeps in FP8 (the LM head, embeddings, norms, the MoE
# router and the shared expert's gate stay in the model dtype).
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_fp8(x):
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_weight(kernel):
    """A float kernel [in, out] (the unquantized layout) -> (weight e4m3 [out, in],
    weight_scale f32 [out]): each output channel scaled so its absmax maps to 448."""
    w = jnp.asarray(kernel, jnp.float32).T
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1), _MIN_SCALE) / FP8_MAX
    return _to_fp8(w / scale[:, None]), scale


def quantize_activation(x, input_scale=None):
    """x [T, in] -> (x8 e4m3 [T, in], scale f32 [T, 1] or []): per token absmax / 448, or
    the static input_scale."""
    xf = x.astype(jnp.float32)
    if input_scale is None:
        scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), _MIN_SCALE) / FP8_MAX
    else:
        scale = jnp.asarray(input_scale, jnp.float32)
    return _to_fp8(xf / scale), scale


def fp8_matmul(x8, weight, out_dtype):
    """x8 [T, K] @ weight[N, K].T in FP8 with f32 accumulation -> [T, N] out_dtype. Both
    operands contracted on their last axis: the operand layout XLA's GEMM rewriter hands
    to cuBLASLt's FP8 GEMM without a transpose. XLA's CPU backend has no FP8 GEMM (its
    float8 dot is slower than an f32 one): there the operands are widened to f32 first,
    the same products (exact in f32) and f32 sums."""
    dims = (((1,), (1,)), ((), ()))
    if jax.default_backend() == "cpu":
        return jax.lax.dot_general(x8.astype(jnp.float32), weight.astype(jnp.float32),
                                   dims).astype(out_dtype)
    return jax.lax.dot_general(x8, weight, dims, preferred_element_type=out_dtype)


def fp8_linear(x, weight, weight_scale, input_scale=None, out_dtype=None):
    """x [T, in] -> [T, out] in out_dtype (default x's dtype): quantize x, FP8 GEMM,
    rescale."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    x8, sx = quantize_activation(x, input_scale)
    y = fp8_matmul(x8, weight, out_dtype)
    return (y.astype(jnp.float32) * (sx * weight_scale)).astype(out_dtype)


def reference_linear(x, weight, weight_scale, input_scale=None):
    """fp8_linear's function in float32: the same quantized operands, dequantized, then an
    exact (HIGHEST precision) dot."""
    x8, sx = quantize_activation(x, input_scale)
    xd = x8.astype(jnp.float32) * sx
    wd = weight.astype(jnp.float32) * weight_scale[:, None]
    return jnp.dot(xd, wd.T, precision=jax.lax.Precision.HIGHEST)


def quantize_params(params: dict, static_input_scales: bool = False) -> dict:
    """A float parameter tree (as the model keeps it) -> the same tree with every
    FP8_PROJECTIONS node {"kernel": [in, out], ...} replaced by {"weight", "weight_scale",
    ...} (biases kept). Works on host (numpy) and traced arrays alike. With
    static_input_scales, each projection gets input_scale 1.0 (a calibration writes the
    real ones)."""
    def walk(node, name=None):
        if not isinstance(node, dict):
            return node
        if name in FP8_PROJECTIONS and "kernel" in node:
            out = {k: v for k, v in node.items() if k != "kernel"}
            out["weight"], out["weight_scale"] = quantize_weight(node["kernel"])
            if static_input_scales:
                out["input_scale"] = jnp.ones((), jnp.float32)
            return out
        return {k: walk(v, k) for k, v in node.items()}
    return walk(params)
