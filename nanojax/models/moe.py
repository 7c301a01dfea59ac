"""Mixture-of-experts FFN in Flax (Mixtral, Qwen2-MoE): the `mlp` nano-op of an MoE layer.

    router:  softmax(h @ W_router) in f32 -> top-k experts per token; Mixtral renormalises
             the k weights (norm_topk_prob), Qwen2-MoE keeps the softmax probabilities
    experts: the T*k (token, expert) pairs sorted by expert, then each SwiGLU GEMM as one
             grouped GEMM over the sorted rows (expert_matmul: group e multiplies
             expert e's weights), then each token sums its k rows times their weights
    shared:  Qwen2-MoE's always-on expert, scaled by sigmoid(h @ w_gate)

Expert weights are stacked [E, in, out]: gate/up [E, hidden, ffn] shard by columns (last
axis) and down [E, ffn, hidden] by rows (axis 1) under tensor parallelism, exactly as the
dense FFN's gate/up/down (TP_SHARDED_AXIS); the router and the shared expert's gate are
replicated. Each rank then holds every expert's slice, so routing needs no all-to-all and
the down projection's partial sums meet in the layer's one all-reduce.

Where the grouped GEMM runs: on a Hopper GPU, the Mosaic GPU grouped GEMM
(pallas_kernels/grouped_matmul_mgpu.py) where it takes the operands; elsewhere
jax.lax.ragged_dot, which jax lowers on the CPU, and XLA on NVIDIA GPUs (RaggedDotRewriter),
as masked dense dots over all experts: on the H200 that ran at a fraction of one dense
GEMM's rate over the same rows, and XLA's cuDNN ragged-dot fusion changed nothing
(bench/results/log/moe.md). KernelConfig.grouped_gemm = "xla" keeps ragged_dot (the A/B).

FP8 (ModelConfig.quantization "fp8", W8A8): each expert stack is {"weight": e4m3 [E, out,
in], "weight_scale": f32 [E, out]} (layers/fp8.py), activations are quantized per token
(the block's input once, before the rows are gathered; SiLU x up per row), the expert
GEMMs accumulate in f32 and write the model dtype (expert_matmul_fp8: the Mosaic GPU FP8
grouped GEMM on Hopper, else XLA's ragged dot on exactly widened operands). The router and
the shared expert's sigmoid gate stay in the model dtype; the shared expert's SwiGLU is
FP8 as a dense FFN's.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import flax.linen as nn

from nanojax.config import ModelConfig
from nanojax.layers.fp8 import FP8, fp8_grouped_matmul, quantize_activation
from nanojax.layers.linear import Linear

# parameter path in the block -> the axis tensor parallelism splits (the dense FFN's
# convention: gate/up by columns, down by rows); the rest is replicated. FP8 weights are
# [.., out, in] (layers/fp8.py): their axes the other way round, their scales follow out
TP_SHARDED_AXIS = {("gate_proj",): 2, ("up_proj",): 2, ("down_proj",): 1,
                   ("shared_gate_proj", "kernel"): 1, ("shared_up_proj", "kernel"): 1,
                   ("shared_down_proj", "kernel"): 0,
                   ("gate_proj", "weight"): 1, ("gate_proj", "weight_scale"): 1,
                   ("up_proj", "weight"): 1, ("up_proj", "weight_scale"): 1,
                   ("down_proj", "weight"): 2,
                   ("shared_gate_proj", "weight"): 0, ("shared_gate_proj", "weight_scale"): 0,
                   ("shared_up_proj", "weight"): 0, ("shared_up_proj", "weight_scale"): 0,
                   ("shared_down_proj", "weight"): 1}


def tp_slice(block_params: dict, rank: int, tp: int) -> dict:
    """Rank `rank`'s shard of one MoE block's parameters under TP degree `tp`: a block of
    the config with ffn widths / tp computes this rank's partial sum of the output."""
    def cut(path, x):
        axis = TP_SHARDED_AXIS.get(tuple(k.key for k in path))
        if axis is None:
            return x
        n = x.shape[axis] // tp
        return jax.lax.slice_in_dim(x, rank * n, (rank + 1) * n, axis=axis)
    return jax.tree_util.tree_map_with_path(cut, block_params)


def expert_matmul(x, w, group_sizes, kernel: str = "auto"):
    """Rows of group e times w[e] (x sorted by expert): the Mosaic GPU grouped GEMM on
    Hopper where it takes the operands ("auto"), else XLA's ragged_dot."""
    if kernel == "auto":
        from pallas_kernels.grouped_matmul_mgpu import (grouped_matmul_mgpu, tiling_for,
                                                        unsupported)
        from pallas_kernels.mosaic_gpu_support import on_hopper
        tiling = tiling_for(x.shape[0], w.shape[-1])
        if on_hopper() and unsupported(x, w, tiling) is None:
            return grouped_matmul_mgpu(x, w, group_sizes, tiling=tiling)
    return jax.lax.ragged_dot(x, w, group_sizes)


def expert_matmul_fp8(x8, x_scale, w: dict, group_sizes, row_expert, out_dtype,
                      kernel: str = "auto"):
    """FP8 rows of group e (x8 [M, K] e4m3, x_scale [M, 1] per row, sorted by expert)
    times expert e's weight w["weight"][e] [N, K] with its channel scales
    w["weight_scale"][e] [N] -> [M, N] out_dtype (f32 accumulation): the Mosaic GPU FP8
    grouped GEMM (scales in its epilogue) on Hopper where it takes the operands ("auto"),
    else XLA's ragged dot, then the scales (row_expert [M]: each row's expert)."""
    weight, w_scale = w["weight"], w["weight_scale"]
    if kernel == "auto":
        from pallas_kernels.grouped_matmul_mgpu import (fp8_tiling_for,
                                                        grouped_matmul_fp8_mgpu,
                                                        unsupported_fp8)
        from pallas_kernels.mosaic_gpu_support import on_hopper
        tiling = fp8_tiling_for(x8.shape[0], weight.shape[1])
        if on_hopper() and unsupported_fp8(x8, weight, tiling, out_dtype) is None:
            return grouped_matmul_fp8_mgpu(x8, x_scale, weight, w_scale, group_sizes,
                                           out_dtype=out_dtype, tiling=tiling)
    y = fp8_grouped_matmul(x8, weight, group_sizes)
    return (y * (x_scale * w_scale[row_expert])).astype(out_dtype)


def fp8_grouped_swiglu(h, src, row_expert, gate, up, down, group_sizes, kernel: str = "auto"):
    """grouped_swiglu in FP8: h [T, hidden] quantized per token once, then its rows
    gathered (src [T*k]: each sorted row's token; the same values as quantizing the
    gathered rows); SiLU x up quantized per row for the down projection."""
    dt = h.dtype
    h8, hs = quantize_activation(h)
    x8, xs = h8[src], hs[src]
    g = expert_matmul_fp8(x8, xs, gate, group_sizes, row_expert, dt, kernel)
    u = expert_matmul_fp8(x8, xs, up, group_sizes, row_expert, dt, kernel)
    a8, a_scale = quantize_activation((nn.silu(g) * u).astype(dt))
    return expert_matmul_fp8(a8, a_scale, down, group_sizes, row_expert, dt, kernel)


class FP8Experts(nn.Module):
    """One stacked expert projection in FP8 (its parameters only): weight e4m3
    [E, out, in] and weight_scale f32 [E, out]. Real weights arrive quantized
    (quantize_params / quantize_bundle); these inits only shape the tree."""
    shape: tuple[int, int, int]  # (E, out, in)

    @nn.compact
    def __call__(self) -> dict:
        e, n, _ = self.shape
        return {"weight": self.param("weight", nn.initializers.zeros, self.shape, FP8),
                "weight_scale": self.param("weight_scale", nn.initializers.ones, (e, n),
                                           jnp.float32)}


def route(logits, k: int, renormalise: bool):
    """Router logits [T, E] -> (top-k weights [T, k] f32, expert ids [T, k] int32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def sort_by_expert(experts, num_experts: int):
    """Expert ids [T, k] -> (order [T*k]: the flat (token, slot) pairs grouped by expert,
    group_sizes [E] int32). Stable, so each group keeps token order."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, sizes


def grouped_swiglu(x_sorted, gate, up, down, group_sizes, kernel: str = "auto"):
    """SwiGLU of rows grouped by expert: rows of group e use expert e's weights."""
    g = expert_matmul(x_sorted, gate, group_sizes, kernel)
    u = expert_matmul(x_sorted, up, group_sizes, kernel)
    return expert_matmul((nn.silu(g) * u).astype(x_sorted.dtype), down, group_sizes, kernel)


class MoEBlock(nn.Module):
    """h [T, hidden] (after the post-attention norm) -> FFN output [T, hidden]."""
    cfg: ModelConfig
    matmul: Callable | None = None  # the router's and shared expert's GEMMs (None: dot)
    grouped_gemm: str = "auto"  # the expert GEMMs (expert_matmul)

    @nn.compact
    def __call__(self, h):
        c, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        e, k, f, d = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.hidden_size
        gate, up, down = self._expert_weights()
        h = h.astype(dt)
        t = h.shape[0]
        weights, experts = route(Linear(e, dt, matmul=self.matmul, name="router")(h), k,
                                 c.norm_topk_prob)
        order, sizes = sort_by_expert(experts, e)
        if c.quantization == "fp8":
            rows = fp8_grouped_swiglu(h, order // k, experts.reshape(-1)[order], gate, up,
                                      down, sizes, self.grouped_gemm)   # [T*k, hidden]
        else:
            rows = grouped_swiglu(h[order // k], gate, up, down, sizes, self.grouped_gemm)
        # back to (token, slot) order: each token's k rows, weighted, summed in f32
        unsort = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
        rows = rows[unsort].reshape(t, k, d).astype(jnp.float32)
        y = jnp.sum(rows * weights[..., None], axis=1)
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            # the shared expert's SwiGLU: FP8 where the model is; its sigmoid gate: never
            lin = lambda n, name, q=c.quantization: Linear(  # noqa: E731
                n, dt, matmul=self.matmul, quantization=q, name=name)
            shared = lin(d, "shared_down_proj")(
                nn.silu(lin(s, "shared_gate_proj")(h)) * lin(s, "shared_up_proj")(h))
            scale = jax.nn.sigmoid(lin(1, "shared_expert_gate", None)(h).astype(jnp.float32))
            y = y + scale * shared.astype(jnp.float32)
        return y.astype(dt)

    def _expert_weights(self):
        """gate, up [E, hidden, ffn] and down [E, ffn, hidden] in the model dtype, or
        FP8Experts' dicts ([E, out, in] e4m3 + scales) for an fp8 model."""
        c, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        e, f, d = c.num_experts, c.moe_intermediate_size, c.hidden_size
        if c.quantization == "fp8":
            return (FP8Experts((e, f, d), name="gate_proj")(),
                    FP8Experts((e, f, d), name="up_proj")(),
                    FP8Experts((e, d, f), name="down_proj")())
        init = nn.initializers.normal(0.02)
        return (self.param("gate_proj", init, (e, d, f), dt),
                self.param("up_proj", init, (e, d, f), dt),
                self.param("down_proj", init, (e, f, d), dt))
