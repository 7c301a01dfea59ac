"""FP8 GEMM with block-wise scales (DeepSeek-V3 / Qwen3-FP8 checkpoints), Mosaic GPU (Hopper).

x8 e4m3 [M, K] with one scale per row and 128-wide group of K (x_scale [M, K/128]),
w8 e4m3 [N, K] with one scale per 128 x 128 block (w_scale [N/128, K/128]) ->
    out[m, n] = sum over groups g of x_scale[m, g] * w_scale[n // 128, g]
                * (x8[m, 128g:128g+128] . w8[n, 128g:128g+128])
in f32, written in a 16-bit dtype. This is the W8A8 function vLLM runs such checkpoints
with (DeepGEMM's); XLA's cuBLASLt FP8 GEMM takes only per-row and per-column scales, so
there the loader requantizes the weights per channel, at a measured cost in accuracy
(bench/results/log/fp8.md). Here nothing is requantized: each K step of 128 is one FP8
WGMMA into a fresh accumulator, promoted into the running f32 sum with that group's row
and column scales (the scales change along K, so they cannot wait for the epilogue).

Layout: a persistent grid walks 64 x 128 output tiles (two register accumulators of 64
f32 a thread: a 128-row tile would need 256 registers a thread), a TMA pipeline over K
brings the operand tiles and each step's scales: x_scale transposed to [K/128, M] and
w_scale expanded to one scale per column [K/128, N] (so that both are TMA-able vectors;
a few MB beside the weights, rebuilt each call: worth keeping at load if the kernel is
timed as worth running). Each step waits for its WGMMA before promoting it, one warpgroup a
program: two consumer warpgroups (or two accumulators in turn) would hide the promotion.
Not timed on a GPU yet.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu_support import fp8_dtype_misfit

FP8 = jnp.float8_e4m3fn
GROUP = 128  # the scales' K group, the weight blocks' side, and the K step of 8-bit WGMMA


class BlockTiling(NamedTuple):
    block_m: int = 64
    block_n: int = 128
    max_concurrent_steps: int = 4
    grid_block_n: int = 1  # column blocks walked together (an L2 swizzle of the tile order)


def unsupported(x8, w8, w_scale=None, tiling: BlockTiling = BlockTiling(),
                out_dtype=jnp.bfloat16) -> str | None:
    """Why the kernel cannot take these operands (None when it can)."""
    if x8.ndim != 2 or w8.ndim != 2 or x8.shape[1] != w8.shape[1]:
        return f"needs [M, K] x [N, K], got {x8.shape} x {w8.shape}"
    if (why := fp8_dtype_misfit(x8, w8, out_dtype)) is not None:
        return why
    (m, k), n = x8.shape, w8.shape[0]
    if w_scale is not None and tuple(w_scale.shape) != (-(-n // GROUP), -(-k // GROUP)):
        return f"w_scale {tuple(w_scale.shape)} is not one scale per {GROUP} x {GROUP} block"
    for name, size, tile in (("M", m, tiling.block_m), ("K", k, GROUP),
                             ("N", n, tiling.block_n * tiling.grid_block_n)):
        if size % tile:
            return f"{name} = {size} is not a multiple of {tile}"
    return None


def quantize_groups(x, group: int = GROUP):
    """x [M, K] -> (x8 e4m3 [M, K], x_scale f32 [M, K/group]): each row's 128-wide groups
    scaled to absmax 448 (vLLM's per_token_group_quant_fp8)."""
    m, k = x.shape
    xg = x.astype(jnp.float32).reshape(m, k // group, group)
    scale = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), 1e-12) / 448.0
    x8 = jnp.clip(xg / scale[..., None], -448.0, 448.0).astype(FP8)
    return x8.reshape(m, k), scale


def block_fp8_matmul_reference(x8, x_scale, w8, w_scale):
    """The same function in f32: both operands dequantized (exact) and one HIGHEST
    precision dot; partial edge blocks allowed."""
    (m, k), n = x8.shape, w8.shape[0]
    sx = jnp.repeat(x_scale.astype(jnp.float32), GROUP, axis=1)[:, :k]
    sw = jnp.repeat(jnp.repeat(w_scale.astype(jnp.float32), GROUP, 0), GROUP, 1)[:n, :k]
    return jnp.dot(x8.astype(jnp.float32) * sx, (w8.astype(jnp.float32) * sw).T,
                   precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "num_programs",
                                             "interpret"))
def block_fp8_matmul_mgpu(x8, x_scale, w8, w_scale, *, out_dtype=jnp.bfloat16,
                          tiling: BlockTiling = BlockTiling(), num_programs: int = 132,
                          interpret: bool = False):
    """x8 [M, K] . w8 [N, K]^T with x_scale [M, K/128] and w_scale [N/128, K/128] applied
    per K group (the module docstring's function), out_dtype out. num_programs: the
    persistent grid (132: the H100's and H200's SMs). interpret: Mosaic GPU's CPU
    interpreter (tests)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.mosaic_gpu_support import interpret_params
    if (why := unsupported(x8, w8, w_scale, tiling, out_dtype)) is not None:
        raise ValueError(why)
    (m, k), n = x8.shape, w8.shape[0]
    rows_t = x_scale.astype(jnp.float32).T                                  # [K/128, M]
    cols_t = jnp.repeat(w_scale.astype(jnp.float32).T, GROUP, axis=1)       # [K/128, N]
    kernel = plgpu.kernel(
        functools.partial(_body, tiling=tiling, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_programs,), grid_names=("sm",),
        compiler_params=None if interpret else plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params() if interpret else None)
    return kernel(x8, rows_t, w8, cols_t)


def _body(x_ref, rows_ref, w_ref, cols_ref, o_ref, *, tiling: BlockTiling, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    (m, k), n = x_ref.shape, w_ref.shape[0]
    bm, bn = tiling.block_m, tiling.block_n
    grid_m, grid_n = m // bm, n // bn

    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def _tile(info):
        mi, ni = plgpu.planar_snake(info.index[0], (grid_m, grid_n), 1, tiling.grid_block_n)

        def step(_, x_smem, w_smem, rows_smem, cols_smem, acc):
            prod = _mma(x_smem, w_smem, bm, bn, interpret)
            rows = _load(rows_smem.at[0], plgpu.Layout.WGMMA.reduce(1), interpret)
            cols = _load(cols_smem.at[0], plgpu.Layout.WGMMA.reduce(0), interpret)
            return acc + (prod * jax.lax.broadcast_in_dim(rows, (bm, bn), [0])
                          * jax.lax.broadcast_in_dim(cols, (bm, bn), [1]))

        zeros = jnp.zeros((bm, bn), jnp.float32)
        acc = plgpu.emit_pipeline(
            step, grid=(k // GROUP,),
            # each step waits for its WGMMA (the promotion reads it), so every buffer is
            # free again when the step returns: no delayed release
            in_specs=[plgpu.BlockSpec((bm, GROUP), lambda kk: (mi, kk)),
                      plgpu.BlockSpec((bn, GROUP), lambda kk: (ni, kk)),
                      plgpu.BlockSpec((1, bm), lambda kk: (kk, mi)),
                      plgpu.BlockSpec((1, bn), lambda kk: (kk, ni))],
            max_concurrent_steps=tiling.max_concurrent_steps,
            init_carry=zeros if interpret else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA),
        )(x_ref, w_ref, rows_ref, cols_ref)

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_ref.dtype))
        def _store(o_smem):
            o_smem[...] = acc.astype(o_ref.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _mma(x_smem, w_smem, bm: int, bn: int, interpret: bool):
    """x_smem [bm, 128] @ w_smem [bn, 128].T into a fresh f32 accumulator: one 8-bit
    WGMMA with w's tile read transposed (K-major, as 8-bit WGMMA needs); the CPU
    interpreter's WGMMA takes no transposed operand, so there a jnp dot."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:
        return jnp.dot(x_smem[...].astype(jnp.float32), w_smem[...].astype(jnp.float32).T,
                       preferred_element_type=jnp.float32)

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(mma, plgpu.ACC((bm, bn)))


def _load(ref, layout, interpret: bool):
    """A scale vector from shared memory in the layout that broadcasts against the WGMMA
    accumulator; the CPU interpreter has no register layouts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return ref[...] if interpret else plgpu.layout_cast(ref[...], layout)
