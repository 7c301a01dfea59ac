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
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import flax.linen as nn

from nanojax.config import ModelConfig
from nanojax.layers.linear import Linear

# parameter path in the block -> the axis tensor parallelism splits (the dense FFN's
# convention: gate/up by columns, down by rows); the rest is replicated
TP_SHARDED_AXIS = {("gate_proj",): 2, ("up_proj",): 2, ("down_proj",): 1,
                   ("shared_gate_proj", "kernel"): 1, ("shared_up_proj", "kernel"): 1,
                   ("shared_down_proj", "kernel"): 0}


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
        init = nn.initializers.normal(0.02)
        gate = self.param("gate_proj", init, (e, d, f), dt)
        up = self.param("up_proj", init, (e, d, f), dt)
        down = self.param("down_proj", init, (e, f, d), dt)
        h = h.astype(dt)
        t = h.shape[0]
        weights, experts = route(Linear(e, dt, matmul=self.matmul, name="router")(h), k,
                                 c.norm_topk_prob)
        order, sizes = sort_by_expert(experts, e)
        rows = grouped_swiglu(h[order // k], gate, up, down, sizes, self.grouped_gemm)   # [T*k, hidden]
        # back to (token, slot) order: each token's k rows, weighted, summed in f32
        unsort = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
        rows = rows[unsort].reshape(t, k, d).astype(jnp.float32)
        y = jnp.sum(rows * weights[..., None], axis=1)
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            lin = lambda n, name: Linear(n, dt, matmul=self.matmul, name=name)  # noqa: E731
            shared = lin(d, "shared_down_proj")(
                nn.silu(lin(s, "shared_gate_proj")(h)) * lin(s, "shared_up_proj")(h))
            scale = jax.nn.sigmoid(lin(1, "shared_expert_gate")(h).astype(jnp.float32))
            y = y + scale * shared.astype(jnp.float32)
        return y.astype(dt)
