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

FP8 (W8A8, the MoE experts of an fp8-quantized model): `grouped_matmul_fp8_mgpu` takes
x8 e4m3 [M, K] with one scale per row, w8 e4m3 [G, N, K] with one scale per (group,
column) (layers/fp8.py's [E, out, in] layout: WGMMA takes 8-bit operands K-major only),
accumulates in f32 and applies both scales in the epilogue, writing a 16-bit output. Its
body is jax's ragged dot walk (GroupInfo reused) with the weight tile read transposed and
K steps of 128 (one 128-byte swizzle row of 8-bit elements).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu_support import fp8_dtype_misfit


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


def _tile_misfit(m: int, k: int, n: int, tiling: GroupedTiling) -> str | None:
    """Which of M, K, N a tiling does not divide (None when it divides all three)."""
    for name, size, tile in (("M", m, tiling.block_m), ("K", k, tiling.block_k),
                             ("N", n, tiling.block_n * tiling.grid_block_n)):
        if size % tile:
            return f"{name} = {size} is not a multiple of {tile}"
    return None


def unsupported(x, w, tiling: GroupedTiling = GroupedTiling()) -> str | None:
    """Why the kernel cannot take these operands (None when it can)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        return f"needs [M, K] x [G, K, N], got {x.shape} x {w.shape}"
    if x.dtype != w.dtype or jnp.dtype(x.dtype).itemsize != 2:
        return f"needs two 16-bit operands of one dtype, got {x.dtype} and {w.dtype}"
    (m, k), n = x.shape, w.shape[2]
    return _tile_misfit(m, k, n, tiling)


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


# ---- FP8 operands ---------------------------------------------------------------------
FP8 = jnp.float8_e4m3fn
FP8_BLOCK_K = 128  # one 128-byte swizzle row of e4m3: the K step 8-bit WGMMA wants


def fp8_tiling_for(m: int, n: int) -> GroupedTiling:
    """tiling_for's output tiles with K steps of 128: 64 x 256 tiles hold 4 stages of
    40 KB and a 32 KB output tile (192 KB of shared memory), 128 x 128 ones 4 x 32 + 32
    KB. Not tuned on a GPU yet."""
    return tiling_for(m, n)._replace(block_k=FP8_BLOCK_K)


def unsupported_fp8(x8, w8, tiling: GroupedTiling | None = None,
                    out_dtype=jnp.bfloat16) -> str | None:
    """Why grouped_matmul_fp8_mgpu cannot take these operands (None when it can)."""
    if x8.ndim != 2 or w8.ndim != 3 or x8.shape[1] != w8.shape[2]:
        return f"needs [M, K] x [G, N, K], got {x8.shape} x {w8.shape}"
    if (why := fp8_dtype_misfit(x8, w8, out_dtype)) is not None:
        return why
    tiling = tiling or fp8_tiling_for(x8.shape[0], w8.shape[1])
    (m, k), n = x8.shape, w8.shape[1]
    return _tile_misfit(m, k, n, tiling)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "num_programs",
                                             "interpret"))
def grouped_matmul_fp8_mgpu(x8, x_scale, w8, w_scale, group_sizes, *, out_dtype=jnp.bfloat16,
                            tiling: GroupedTiling | None = None, num_programs: int = 132,
                            interpret: bool = False):
    """Rows of group g of x8 [M, K] times w8[g].T, scaled: out[r, c] = (x8[r] . w8[g, c])
    * x_scale[r] * w_scale[g, c], f32 accumulation, out_dtype out. x_scale [M] or [M, 1],
    w_scale [G, N] f32. tiling: None picks fp8_tiling_for(M, N). num_programs: the
    persistent grid (jax's ragged dot: 132, the H100's and H200's SMs), each program
    walking tiles until none is left. interpret: Mosaic GPU's CPU interpreter (tests)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.mosaic_gpu_support import interpret_params
    tiling = tiling or fp8_tiling_for(x8.shape[0], w8.shape[1])
    if (why := unsupported_fp8(x8, w8, tiling, out_dtype)) is not None:
        raise ValueError(why)
    m, n = x8.shape[0], w8.shape[1]
    kernel = plgpu.kernel(
        functools.partial(_fp8_body, tiling=tiling, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        # a tile's row and column scales, TMA'd in while its K loop runs
        scratch_types=[plgpu.SMEM((tiling.block_m,), jnp.float32),
                       plgpu.SMEM((tiling.block_n,), jnp.float32),
                       plgpu.Barrier(num_arrivals=2)],
        grid=(num_programs,), grid_names=("sm",),
        compiler_params=None if interpret else plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params() if interpret else None)
    return kernel(group_sizes.astype(jnp.int32), x8,
                  x_scale.reshape(m).astype(jnp.float32), w8,
                  w_scale.astype(jnp.float32))


def _fp8_body(sizes_ref, x_ref, sx_ref, w_ref, sw_ref, o_ref, rows_smem, cols_smem, bar,
              *, tiling: GroupedTiling, interpret: bool):
    """The persistent loop over (row block, column block) tiles; each tile's row block
    belongs to one group (jax's GroupInfo: a block straddling groups is visited once per
    group, storing only that group's rows)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import GroupInfo
    (m, k), (g, n, _) = x_ref.shape, w_ref.shape
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    grid_m, grid_n = pl.cdiv(m, bm) + g - 1, n // bn

    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def _tile(info):
        mi, ni = plgpu.planar_snake(info.index[0], (grid_m, grid_n), 1, tiling.grid_block_n)
        group = GroupInfo.create(sizes_ref, bm, mi)
        plgpu.copy_gmem_to_smem(sx_ref.at[pl.ds(group.block_start, bm)], rows_smem, bar)
        plgpu.copy_gmem_to_smem(sw_ref.at[group.group_id, pl.ds(ni * bn, bn)], cols_smem, bar)

        def k_loop(acc_ref):
            if interpret:
                acc_ref[...] = jnp.zeros((bm, bn), jnp.float32)
            plgpu.emit_pipeline(
                lambda _, x_smem, w_smem: _mma(acc_ref, x_smem, w_smem, interpret),
                grid=(k // bk,),
                in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (group.block, kk),
                                          delay_release=1),
                          plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=1)],
                max_concurrent_steps=tiling.max_concurrent_steps,
            )(x_ref, w_ref.at[group.group_id])
            return acc_ref[...]

        acc = pl.run_scoped(k_loop, plgpu.SMEM((bm, bn), jnp.float32) if interpret
                            else plgpu.ACC((bm, bn)))
        plgpu.barrier_wait(bar)
        rows = _load(rows_smem, plgpu.Layout.WGMMA.reduce(1), interpret)
        cols = _load(cols_smem, plgpu.Layout.WGMMA.reduce(0), interpret)
        out = (acc * jax.lax.broadcast_in_dim(rows, (bm, bn), [0])
               * jax.lax.broadcast_in_dim(cols, (bm, bn), [1]))
        _store_group_rows(out.astype(o_ref.dtype), o_ref, group, ni * bn, min(bm, m))


def _mma(acc_ref, x_smem, w_smem, interpret: bool):
    """acc += x_smem [bm, bk] @ w_smem [bn, bk].T: one WGMMA, w's tile read transposed
    (K-major, as 8-bit WGMMA needs); the CPU interpreter's WGMMA takes no transposed
    operand, so there the same sum is a jnp dot into an f32 buffer."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:
        acc_ref[...] += jnp.dot(x_smem[...].astype(jnp.float32),
                                w_smem[...].astype(jnp.float32).T,
                                preferred_element_type=jnp.float32)
    else:
        plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))


def _load(ref, layout, interpret: bool):
    """A scale vector from shared memory in the layout that broadcasts against the
    WGMMA accumulator (rows: WGMMA.reduce(1), columns: WGMMA.reduce(0)); the CPU
    interpreter has no register layouts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return ref[...] if interpret else plgpu.layout_cast(ref[...], layout)


def _store_group_rows(tile, o_ref, group, col: int, max_rows: int):
    """Stores the group's rows of an output tile: TMA boxes have static sizes, so the
    row count (known at run time) is stored as a sum of powers of two, one box each (jax's
    ragged dot's ladder)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    bm, bn = tile.shape

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_ref.dtype))
    def _scope(o_smem):
        o_smem[...] = tile
        plgpu.commit_smem()
        start = group.start_within_block
        remaining = max_rows
        while remaining > 0:
            rows = 1 << (remaining.bit_length() - 1)
            remaining //= 2

            @pl.when(group.actual_size & rows != 0)
            def _():
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(start, rows)],
                    o_ref.at[pl.ds(group.block_start + start, rows), pl.ds(col, bn)])

            start += group.actual_size & rows
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul_fp8_reference(x8, x_scale, w8, w_scale, group_sizes):
    """The same function in f32: both operands dequantized (exact), each group's dot at
    HIGHEST precision (layers/fp8.py's reference_grouped_matmul, restated here so that
    the kernel module imports only jax and numpy)."""
    xd = x8.astype(jnp.float32) * x_scale.reshape(-1, 1).astype(jnp.float32)
    wd = w8.astype(jnp.float32) * w_scale.astype(jnp.float32)[..., None]
    return jax.lax.ragged_dot(xd, jnp.swapaxes(wd, 1, 2), group_sizes.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST)
