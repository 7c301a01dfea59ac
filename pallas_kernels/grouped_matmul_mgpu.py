"""Grouped GEMM for mixture-of-experts layers (rows sorted by expert), Mosaic GPU (Hopper).

x [M, K] rows sorted by group, w [G, K, N], group_sizes [G] (summing to M) -> [M, N]:
the rows of group g times w[g]. This is jax.lax.ragged_dot's contract.

Why: XLA lowers ragged_dot on NVIDIA GPUs as a masked dense product over every group (its
RaggedDotRewriter); on the H200 the Mixtral-8x7B expert GEMM ran at a fraction of one
dense GEMM's rate over the same rows, with or without XLA's cuDNN ragged-dot fusion
(bench/results/moe/moe_grouped_gemm_probe_h200.json, bench/results/log/moe.md), so an
MoE step spent most of its time there. The kernel body is jax's own Hopper ragged dot
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`): a persistent grid walks (row block,
column block) tiles, each row block belongs to one group (a block that straddles two
groups is visited once for each, storing only its own rows), a TMA pipeline over K feeds
WGMMA. This module checks the shapes it tiles, picks the tiling measured on the H200 and
keeps the pure-JAX reference beside it. jax's kernel has no interpret mode, so the CPU
tests check the CUDA lowering (jax.export) and the reference; the GPU test compares the
two (tests/test_grouped_matmul_mgpu.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupedTiling(NamedTuple):
    """Output tile block_m x block_n (one warpgroup's WGMMA accumulator), K steps of
    block_k, max_concurrent_steps in flight, grid_block_n column blocks walked together
    (an L2 swizzle of the tile order). 128 x 128 x 64 x 4 stages: 160 KB of shared memory."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


# 64 x 256 tiles (4 stages, 192 KB of shared memory) timed faster than 128 x 128 on the
# H200 at every Mixtral-8x7B expert shape above 128 rows; at 128 rows the down projection
# lost, so small batches keep 128 x 128 (bench/results/moe/
# moe_grouped_gemm_probe_decode_h200.json, bench/results/log/moe.md).
WIDE_TILING = GroupedTiling(block_m=64, block_n=256)


def tiling_for(m: int, n: int) -> GroupedTiling:
    """The tiling for M rows and N output columns: WIDE_TILING above 128 rows where N
    takes it, else the default."""
    return WIDE_TILING if m > 128 and n % WIDE_TILING.block_n == 0 else GroupedTiling()


def unsupported(x, w, tiling: GroupedTiling = GroupedTiling()) -> str | None:
    """Why the kernel cannot take these operands (None when it can)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        return f"needs [M, K] x [G, K, N], got {x.shape} x {w.shape}"
    if x.dtype != w.dtype or jnp.dtype(x.dtype).itemsize != 2:
        return f"needs two 16-bit operands of one dtype, got {x.dtype} and {w.dtype}"
    (m, k), n = x.shape, w.shape[2]
    for name, size, tile in (("M", m, tiling.block_m), ("K", k, tiling.block_k),
                             ("N", n, tiling.block_n * tiling.grid_block_n)):
        if size % tile:
            return f"{name} = {size} is not a multiple of {tile}"
    return None


@functools.partial(jax.jit, static_argnames=("tiling",))
def grouped_matmul_mgpu(x, w, group_sizes, *, tiling: GroupedTiling | None = None):
    """Rows of group g of x times w[g] (f32 accumulation, x's dtype out). tiling: None
    picks tiling_for(M, N)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    tiling = tiling or tiling_for(x.shape[0], w.shape[-1])
    if (why := unsupported(x, w, tiling)) is not None:
        raise ValueError(why)
    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes.astype(jnp.int32),
                                      **tiling._asdict())


def grouped_matmul_reference(x, w, group_sizes):
    """The same product in f32, group by group (XLA's ragged_dot)."""
    return jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32),
                              group_sizes.astype(jnp.int32))
