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

An MoE block's stacked expert weights (models/moe.py; float [E, in, out]) quantize the
same way per (expert, output channel): weight e4m3 [E, out, in], weight_scale f32 [E, out]
(`quantize_weight` on the stack). Their grouped GEMM is `fp8_grouped_matmul` here (XLA)
or the Mosaic GPU kernel of pallas_kernels/grouped_matmul_mgpu.py (moe.expert_matmul_fp8).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0          # the largest finite e4m3fn value
_MIN_SCALE = 1e-12       # an all-zero row or channel gets this scale, not a division by 0

# The projections a quantized model keeps in FP8 (the LM head, embeddings, norms, the MoE
# router and the shared expert's sigmoid gate stay in the model dtype; the shared expert's
# own SwiGLU is a dense FFN and goes FP8).
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "shared_gate_proj", "shared_up_proj", "shared_down_proj")
# An MoE block's stacked expert weights: arrays [E, in, out] under these names, not Linears
FP8_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def to_fp8(x):
    """Saturating cast to e4m3: values past +-448 clip instead of becoming NaN."""
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_weight(kernel):
    """A float kernel [..., in, out] (the unquantized layout; a stack of experts
    [E, in, out] too) -> (weight e4m3 [..., out, in], weight_scale f32 [..., out]): each
    output channel (of each expert) scaled so its absmax maps to 448."""
    w = jnp.swapaxes(jnp.asarray(kernel, jnp.float32), -1, -2)
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=-1), _MIN_SCALE) / FP8_MAX
    return to_fp8(w / scale[..., None]), scale


WEIGHT_BLOCK = 128  # "fp8-block": the weights' scale blocks, the activations' K groups


def quantize_weight_blocks(kernel, block: int = WEIGHT_BLOCK):
    """A float kernel [in, out] -> (weight e4m3 [out, in], weight_scale f32
    [ceil(out/block), ceil(in/block)]): each block x block tile (edge tiles partial) scaled
    so its absmax maps to 448, as block-wise FP8 checkpoints are made."""
    w = jnp.swapaxes(jnp.asarray(kernel, jnp.float32), -1, -2)
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    tiles = jnp.zeros((nb * block, kb * block), jnp.float32).at[:n, :k].set(w)
    amax = jnp.max(jnp.abs(tiles.reshape(nb, block, kb, block)), axis=(1, 3))
    scale = jnp.maximum(amax, _MIN_SCALE) / FP8_MAX
    return to_fp8(w / expand_blocks(scale, (block, block), (n, k))), scale


def expand_blocks(scale, block: tuple[int, int], shape: tuple[int, int]):
    """Block scales [ceil(n/rows), ceil(k/cols)] -> one per element [n, k] (shape)."""
    (rows, cols), (n, k) = block, shape
    return jnp.repeat(jnp.repeat(scale, rows, axis=0), cols, axis=1)[:n, :k]


def fp8_block_linear(x, weight, weight_scale, out_dtype):
    """x [T, in] -> [T, out] with a block-wise FP8 weight (quantize_weight_blocks' layout):
    x quantized per token and 128-wide group, then the block-scaled GEMM: the Mosaic GPU
    kernel on a Hopper GPU (the rows padded to its tiles) where it tiles the weight, else
    its reference (both operands dequantized, one f32 dot: on the CPU the FP8 products are
    exact in f32 anyway; on a GPU a slow path, for weights of no multiple of 128)."""
    from pallas_kernels.block_fp8_matmul_mgpu import (BlockTiling, block_fp8_matmul_mgpu,
                                                      block_fp8_matmul_reference,
                                                      quantize_groups, unsupported)
    out_dtype = jnp.dtype(out_dtype)
    t, k = x.shape
    pad = -k % WEIGHT_BLOCK  # a partial last group: zeros change no absmax and no sum
    x8, sx = quantize_groups(jnp.pad(x, ((0, 0), (0, pad))) if pad else x, WEIGHT_BLOCK)
    x8 = x8[:, :k]
    if jax.default_backend() == "gpu":
        from pallas_kernels.device import device_sms
        from pallas_kernels.mosaic_gpu_support import on_hopper
        rows = -t % BlockTiling().block_m  # the kernel's row tiles: pad a small batch
        x8p = jnp.pad(x8, ((0, rows), (0, 0))) if rows else x8
        if on_hopper() and unsupported(x8p, weight, weight_scale, out_dtype=out_dtype) is None:
            sxp = jnp.pad(sx, ((0, rows), (0, 0)), constant_values=1.0) if rows else sx
            return block_fp8_matmul_mgpu(x8p, sxp, weight, weight_scale, out_dtype=out_dtype,
                                         num_programs=device_sms())[:t]
    return block_fp8_matmul_reference(x8, sx, weight, weight_scale).astype(out_dtype)


def requantize_blocks(weight, block_scale, block: tuple[int, int]):
    """A block-wise FP8 weight (DeepSeek-V3 / Qwen3-FP8 style: e4m3 [out, in], one scale
    per block of block[0] rows x block[1] columns, edge blocks partial) -> the per-channel
    (weight e4m3 [out, in], weight_scale f32 [out]) that fp8_linear takes: dequantized,
    then each output channel scaled to absmax 448 again. The second rounding costs
    accuracy (the measurement: bench/results/log/fp8.md); a GEMM that applies the block
    scales itself would not."""
    s = expand_blocks(jnp.asarray(block_scale, jnp.float32), block, weight.shape)
    w = weight.astype(jnp.float32) * s
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=-1), _MIN_SCALE) / FP8_MAX
    return to_fp8(w / scale[:, None]), scale


def is_expert_stack(name, node) -> bool:
    """Is this parameter node an MoE block's stacked float expert weight [E, in, out]?"""
    return (name in FP8_EXPERT_PROJECTIONS and not isinstance(node, dict)
            and getattr(node, "ndim", 0) == 3)


def quantize_experts(stack) -> dict:
    """Stacked float expert weights [E, in, out] -> {"weight": e4m3 [E, out, in],
    "weight_scale": f32 [E, out]}: the node an FP8 MoE block declares."""
    weight, scale = quantize_weight(stack)
    return {"weight": weight, "weight_scale": scale}


def quantize_activation(x, input_scale=None):
    """x [T, in] -> (x8 e4m3 [T, in], scale f32 [T, 1] or []): per token absmax / 448, or
    the static input_scale."""
    xf = x.astype(jnp.float32)
    if input_scale is None:
        scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), _MIN_SCALE) / FP8_MAX
    else:
        scale = jnp.asarray(input_scale, jnp.float32)
    return to_fp8(xf / scale), scale


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


def fp8_grouped_matmul(x8, weight, group_sizes):
    """Rows of group e of x8 [M, K] times expert e's weight[e] [N, K] (transposed) ->
    [M, N] f32, unscaled: XLA's ragged dot, weight contracted on its last axis (the
    [E, out, in] layout kept for the Mosaic GPU kernel: K-major, as FP8 WGMMA wants).
    The operands are widened first, as exact values: to f32 on the CPU (fp8_matmul's
    reason), to bf16 elsewhere (XLA's ragged-dot rewrite is not known to take FP8, and
    every e4m3 value is a bf16 one); the GPU's FP8 path is the Mosaic kernel."""
    wide = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(x8.astype(wide), weight.astype(wide),
                                      group_sizes.astype(jnp.int32), dims,
                                      preferred_element_type=jnp.float32)


def reference_grouped_matmul(x8, x_scale, weight, weight_scale, group_sizes):
    """fp8_grouped_matmul's product with both scales applied, in float32: the quantized
    operands dequantized (x_scale [M, 1] per row, weight_scale [E, N]), then each group's
    exact (HIGHEST precision) dot."""
    xd = x8.astype(jnp.float32) * x_scale
    wd = weight.astype(jnp.float32) * weight_scale[..., None]
    return jax.lax.ragged_dot(xd, jnp.swapaxes(wd, 1, 2), group_sizes.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST)


class QuantizedActivation(NamedTuple):
    """Activations already quantized per token by their producer (the fused kernels of
    pallas_kernels/act_quant.py): what an FP8 projection takes in place of x."""
    values: jax.Array  # [T, in] e4m3
    scale: jax.Array   # [T, 1] f32


class ScaledOutput(NamedTuple):
    """An FP8 projection's output before its dequantization (fp8_gemm): the output is
    values x row_scale x col_scale, for a consumer kernel to apply in its own pass over
    them (pallas_kernels/act_quant.py's silu_mul_quant)."""
    values: jax.Array     # [T, out] the GEMM's, in the model dtype
    row_scale: jax.Array  # [T, 1] f32 per token ([] for a static input scale)
    col_scale: jax.Array  # [out] f32 per output channel


def fp8_gemm(x, weight, weight_scale, input_scale=None, out_dtype=None) -> ScaledOutput:
    """x [T, in] -> its FP8 product with weight, unscaled: quantize x (unless it is a
    QuantizedActivation: then out_dtype is needed), the FP8 GEMM into out_dtype (default
    x's dtype), and the scales that dequantize it."""
    if isinstance(x, QuantizedActivation):
        assert out_dtype is not None, "an FP8 input has no output dtype to keep"
        x8, sx = x
    else:
        x8, sx = quantize_activation(x, input_scale)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    return ScaledOutput(fp8_matmul(x8, weight, out_dtype), sx, weight_scale)


def fp8_linear(x, weight, weight_scale, input_scale=None, out_dtype=None):
    """x [T, in] -> [T, out] in out_dtype (default x's dtype): quantize x, FP8 GEMM,
    rescale (fp8_gemm's output dequantized)."""
    y, sx, sw = fp8_gemm(x, weight, weight_scale, input_scale, out_dtype)
    return (y.astype(jnp.float32) * (sx * sw)).astype(y.dtype)


def reference_linear(x, weight, weight_scale, input_scale=None):
    """fp8_linear's function in float32: the same quantized operands, dequantized, then an
    exact (HIGHEST precision) dot."""
    x8, sx = quantize_activation(x, input_scale)
    xd = x8.astype(jnp.float32) * sx
    wd = weight.astype(jnp.float32) * weight_scale[:, None]
    return jnp.dot(xd, wd.T, precision=jax.lax.Precision.HIGHEST)


def quantize_params(params: dict, static_input_scales: bool = False,
                    blocks: bool = False) -> dict:
    """A float parameter tree (as the model keeps it) -> the same tree with every
    FP8_PROJECTIONS node {"kernel": [in, out], ...} replaced by {"weight", "weight_scale",
    ...} (biases kept) and every MoE expert stack [E, in, out] by quantize_experts' node.
    Works on host (numpy) and traced arrays alike. With static_input_scales, each
    projection gets input_scale 1.0 (a calibration writes the real ones; MoE models take
    dynamic scales only, ModelConfig says so). blocks: "fp8-block" weights
    (quantize_weight_blocks) in place of per-channel ones."""
    quantize = quantize_weight_blocks if blocks else quantize_weight
    def walk(node, name=None):
        if is_expert_stack(name, node):
            return quantize_experts(node)
        if not isinstance(node, dict):
            return node
        if name in FP8_PROJECTIONS and "kernel" in node:
            out = {k: v for k, v in node.items() if k != "kernel"}
            out["weight"], out["weight_scale"] = quantize(node["kernel"])
            if static_input_scales:
                out["input_scale"] = jnp.ones((), jnp.float32)
            return out
        return {k: walk(v, k) for k, v in node.items()}
    return walk(params)
