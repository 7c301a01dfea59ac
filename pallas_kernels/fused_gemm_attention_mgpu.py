"""A GEMM of one nano-batch and the decode attention of another in ONE Mosaic GPU launch,
split by program id (Hopper).

Why: NanoFlow overlaps nano-batch i's GEMM with nano-batch j's decode attention, each on
its share of the SMs. Two XLA streams do not split the SMs (bounded pairs on two streams
ran slower than back to back: bench/results/bounded_overlap_probe_h200.json,
bench/results/log/overlap_search.md), so the split is made inside one persistent kernel,
as FlashInfer's POD-Attention does: a grid of N programs (one per SM), programs [0, G) run
the GEMM's output-tile loop striding by G, programs [G, N) run the swap-AB decode
attention's work-item loop striding by N - G. G is the plan's GEMM share.

Design:
  * one kernel-wide thread shape: 3 warpgroups ("wg") per program. The GEMM branch is a
    warp-specialized pipeline (warpgroup 2 issues the TMA copies of A and B over K with
    40 registers, warpgroups 0 and 1 each own a 128 x 128 f32 WGMMA accumulator, side by
    side along N: 128 x 256 output tiles, the layout of matmul_mgpu.py / jax's Hopper
    matmul; 128 x 128 tiles with 6 K steps in flight where those fill the programs'
    last wave better, gemm_config). The attention branch is decode_attention_swapab.py's per-program body
    (`swapab_call(...).body`) with 3 independent workers, as that kernel runs on a
    bounded grid anyway.
  * shared memory is allocated inside each branch (`pl.run_scoped`, collective over
    "wg"): the kernel takes the larger branch, not the sum. At the LLaMA-3-8B shapes
    (bf16, D 128, 64-key blocks, 2 stages, 4 GEMM K-steps in flight): GEMM 4 x 48 KB of
    A/B tiles + 32 KB of epilogue tiles = 224 KB; attention 3 workers x (2 stages x 32 KB
    of K/V + 8 KB of query/P/output/reduction tiles) = 216 KB; the H200 has 227 KB a
    block. Both are counted by hand (the CUDA lowering does not check it): the GEMM's in
    `unsupported()`, the attention's when its call is built (a ValueError).
  * both branches lower with Lane semantics (the attention body needs them; the GEMM's
    pipeline and WGMMA lower in either).
  * the GEMM walks output tiles M-fastest (a program's successive tiles are G apart, so
    at any time the G running tiles cover all of A's row blocks and a few of B's column
    blocks: B, the large operand, is read from DRAM about once).

Checked on the CPU only: Mosaic GPU's interpreter against the references (the attention
body's interpret path is its jnp twin, see decode_attention_swapab.py), and the CUDA
lowering with jax 0.10 and 0.11 at the 8B nano-batch shapes (tests/test_fused_gemm_
attention_mgpu.py). Not yet run on a GPU: register allocation of the fused kernel (the
GEMM's consumer warpgroups raise theirs to 232 with setmaxnreg, the attention's keep the
launch's), its speed (bench/kernels/fused_pair.py), and its results compiled.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import decode_attention_swapab as swapab
from pallas_kernels.decode_attention import decode_attention_reference
from pallas_kernels.device import device_sms
from pallas_kernels.matmul_mgpu import default_config, matmul_reference
from pallas_kernels.matmul_mgpu import unsupported as gemm_unsupported
from pallas_kernels.mosaic_gpu_support import interpret_params

WARPGROUPS = 3  # kernel-wide: the GEMM's 1 producer + 2 consumers; 3 attention workers
SMEM_BYTES = 227 * 1024  # shared memory a block may use on the H100 / H200
_BARRIER_BYTES = 8


def _swizzle_transforms(minor_elems: int, dtype):
    """Tiling + the largest swizzle (128, 64 or 32 bytes) the minor dimension holds."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    nbytes = minor_elems * jnp.dtype(dtype).itemsize
    swz = next(s for s in (128, 64, 32) if nbytes % s == 0)
    return (plgpu.TilingTransform((8, swz // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swz))


def wave_fill(m: int, n: int, cta_n: int, programs: int, tile_m: int = 128) -> float:
    """The programs' average busy share over the waves of tile_m x cta_n output tiles of
    an [m, n] product (0.0 where the tiles do not divide it or no program runs)."""
    if m % tile_m or n % cta_n or programs <= 0:
        return 0.0
    tiles = (m // tile_m) * (n // cta_n)
    return tiles / (-(-tiles // programs) * programs)


def gemm_config(m: int, n: int, programs: int):
    """The GEMM's tiling for an [m, n] output on `programs` programs: matmul_mgpu's 128 x
    256 tiles, or 128 x 128 with 6 K steps in flight where the large tiles leave the last
    wave mostly empty (under 85% of the programs busy on average) and the small ones fill
    it better (qkv at 1,024 tokens on 132 SMs has 192 large tiles, 1.45 waves: its GEMM
    part ran closer to XLA's GEMM with the small ones); where both fill their waves the
    large tiles are faster (bench/kernels/gemm_tiles.py,
    bench/results/log/overlap_search.md)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    large = default_config()
    fill_large, fill_small = (wave_fill(m, n, 2 * large.tile_n, programs),
                              wave_fill(m, n, 128, programs))
    if fill_large < 0.85 and fill_small > fill_large:
        return hm.TuningConfig(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=6,
                               epi_tile_m=64, epi_tile_n=64)
    return large


def gemm_smem_bytes(dtype, config=None) -> int:
    """Shared memory of the GEMM branch: the A and B tiles in flight, two epilogue slots a
    consumer, and the pipeline's barriers (2 a step in flight, an estimate)."""
    config = config or default_config()
    isz = jnp.dtype(dtype).itemsize
    step = (config.tile_m * config.tile_k + config.tile_k * 2 * config.tile_n) * isz
    epi = 2 * 2 * config.epi_tile_m * config.epi_tile_n * isz
    return config.max_concurrent_steps * (step + 2 * 2 * _BARRIER_BYTES) + epi


def scratch_bytes(types) -> int:
    """Bytes of a list of plgpu.SMEM / plgpu.Barrier scratch types (no alignment)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    total = 0
    for t in types:
        if isinstance(t, plgpu.Barrier):
            nb = t.num_barriers  # an int, or a shape (jax 0.10 stores a tuple)
            total += math.prod(nb if isinstance(nb, tuple) else (nb,)) * _BARRIER_BYTES
        else:
            total += int(jnp.dtype(t.dtype).itemsize) * math.prod(t.shape)
    return total


def unsupported(a, b, q, k_pages, *, gemm_programs: int, num_programs: int,
                config=None) -> str | None:
    """Why the fused kernel cannot take these operands or this split (None when it can)."""
    if config is None and a.ndim == b.ndim == 2 and gemm_programs > 0:
        config = gemm_config(a.shape[0], b.shape[1], gemm_programs)
    if (why := gemm_unsupported(a, b, config)) is not None:
        return f"GEMM: {why}"
    if (why := swapab.unsupported(q, k_pages)) is not None:
        return f"attention: {why}"
    if not 0 < gemm_programs < num_programs:
        return (f"gemm_programs {gemm_programs} must leave both sides programs: "
                f"0 < G < {num_programs}")
    if (need := gemm_smem_bytes(a.dtype, config)) > SMEM_BYTES:
        return f"GEMM tiles need {need} bytes of shared memory, a block has {SMEM_BYTES}"
    return None


def gemm_program(a_ref, b_ref, out_ref, program, programs: int, config, wg):
    """One GEMM program: output tiles program, program + programs, ... of out = a @ b, each
    through a warp-specialized TMA pipeline over K (3 warpgroups; wg: this one's index on
    the axis "wg")."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    (m, k), n = a_ref.shape, b_ref.shape[1]
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    cta_n = 2 * tn  # consumer warpgroup w computes columns [w tn, (w + 1) tn) of a tile
    m_tiles, n_tiles = m // tm, n // cta_n
    epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
    # A's [tm, tk] and B's [tk, cta_n] tiles: the swizzle a tk-long row holds (128 bytes
    # at tk 64), B's rows tiled by the same 64 columns
    in_tf = _swizzle_transforms(tk, a_ref.dtype)
    out_tf = _swizzle_transforms(epi_n, out_ref.dtype)

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma, grid=(k // tk,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=in_tf,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((tk, cta_n), lambda kk: (kk, 0), transforms=in_tf,
                                      memory_space=plgpu.SMEM)],
            wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=config.max_concurrent_steps, compute_context=context)

    def scope(allocs, out_smem):
        wg_cols = pl.ds(wg * tn, tn)

        def tile(i, carry):
            lin = program + i * programs
            rows = pl.ds((lin % m_tiles) * tm, tm)  # M fastest: see the module doc
            cols = pl.ds((lin // m_tiles) * cta_n, cta_n)

            def context(run):
                def with_acc(acc_ref):
                    run(acc_ref)
                    acc = acc_ref[...].astype(out_ref.dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for e in range((tm // epi_m) * (tn // epi_n)):
                        em, en = divmod(e, tn // epi_n)
                        sub_m, sub_n = slice(em * epi_m, (em + 1) * epi_m), slice(
                            en * epi_n, (en + 1) * epi_n)
                        slot = e % 2
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # slot is free
                        out_smem[wg, slot] = acc[sub_m, sub_n]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot],
                            out_ref.at[rows, cols].at[:, wg_cols].at[sub_m, sub_n])
                pl.run_scoped(with_acc, plgpu.ACC((tm, tn), jnp.float32))

            def mma(_, a_smem, b_smem, acc_ref):
                plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, wg_cols])
                plgpu.wgmma_wait(0)
                return acc_ref

            pipeline(mma, context)(a_ref.at[rows, :], b_ref.at[:, cols], allocations=allocs)
            return carry

        count = (m_tiles * n_tiles - program + programs - 1) // programs
        lax.fori_loop(0, count, tile, None)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    ignore = lambda *_, **__: None  # noqa: E731 (allocations do not depend on the body)
    pl.run_scoped(scope, pipeline(ignore, ignore).get_allocations(a_ref, b_ref),
                  plgpu.SMEM((2, 2, epi_m, epi_n), out_ref.dtype, transforms=out_tf),
                  collective_axes="wg")


@functools.partial(jax.jit, static_argnames=("num_programs", "config", "interpret"))
def gemm_part(a, b, *, num_programs: int | None = None, config=None,
              interpret: bool = False):
    """The fused kernel's GEMM alone, a @ b on num_programs programs (None: one per SM):
    the same body, threads and lowering, to time it against XLA's GEMM and to learn what
    the pair costs beyond its parts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if num_programs is None:
        num_programs = device_sms()
    config = config or gemm_config(a.shape[0], b.shape[1], num_programs)
    if (why := gemm_unsupported(a, b, config)) is not None:
        raise ValueError(f"GEMM: {why}")

    def body(a_ref, b_ref, c_ref):
        gemm_program(a_ref, b_ref, c_ref, lax.axis_index("p"), num_programs, config,
                     lax.axis_index("wg"))
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype),
        grid=(num_programs,), grid_names=("p",), num_threads=WARPGROUPS, thread_name="wg",
        kernel_name="fused_pair_gemm",  # in profiles: the kernel's name
        compiler_params=None if interpret else swapab.compiler_params(),
        interpret=interpret_params() if interpret else None,
    )(a, b)


@functools.partial(jax.jit, static_argnames=(
    "gemm_programs", "num_programs", "config", "block_k", "stages", "splits",
    "approx_math", "interpret"))
def fused_gemm_attention(a, b, q, k_pages, v_pages, page_table, context_lens, *,
                         gemm_programs: int, num_programs: int | None = None, config=None,
                         block_k: int = 64, stages: int | None = None,
                         splits: int | None = None, approx_math: bool = True,
                         k_scale=None, v_scale=None, interpret: bool = False):
    """(a [M, K] @ b [K, N] in a's dtype with f32 accumulation, decode attention of q
    [B, H, D] over pages [N, KVH, ps, D] -> [B, H, D]) in one launch of num_programs
    programs (None: one per SM): programs [0, gemm_programs) run the GEMM, the rest the
    attention (swap-AB, 3 workers a program; block_k, stages, splits, k_scale, v_scale as
    in decode_attention_swapab)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if num_programs is None:
        num_programs = device_sms()
    g = gemm_programs
    config = config or gemm_config(a.shape[0], b.shape[1], g)
    if (why := unsupported(a, b, q, k_pages, gemm_programs=g, num_programs=num_programs,
                           config=config)) is not None:
        raise ValueError(why)
    call = swapab.swapab_call(q, k_pages, v_pages, page_table, context_lens,
                              num_programs=num_programs - g, block_k=block_k, stages=stages,
                              warpgroups=WARPGROUPS, splits=splits, k_scale=k_scale,
                              v_scale=v_scale, interpret=interpret)
    if (need := scratch_bytes(call.scratch)) > SMEM_BYTES:
        raise ValueError(f"attention: {need} bytes of shared memory at {WARPGROUPS} workers, "
                         f"a block has {SMEM_BYTES} (fewer stages or a smaller block_k)")
    att_types = call.out_type if isinstance(call.out_type, tuple) else (call.out_type,)
    n_in = len(call.operands)

    def body(a_ref, b_ref, *refs):
        att_in, (c_ref, *att_out) = refs[:n_in], refs[n_in:]
        pid = lax.axis_index("p")
        # read outside the branches: jax 0.10's interpreter caches the thread index the
        # first time it is read, and a branch's value would leak into the other branch
        wg = lax.axis_index("wg")

        @pl.when(pid < g)
        def _gemm():
            gemm_program(a_ref, b_ref, c_ref, pid, g, config, wg)

        @pl.when(pid >= g)
        def _attention():
            pl.run_scoped(lambda *scratch: call.body(pid - g, *att_in, *att_out, *scratch),
                          *call.scratch, collective_axes="wg")

    out = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype),
                        *att_types),
        grid=(g + call.programs,), grid_names=("p",), num_threads=WARPGROUPS,
        thread_name="wg", kernel_name="fused_gemm_attention",
        compiler_params=None if interpret else swapab.compiler_params(approx_math),
        interpret=interpret_params() if interpret else None,
    )(a, b, *call.operands)
    c, *att = out
    return c, call.finish(att[0] if len(att) == 1 else tuple(att))


def fused_reference(a, b, q, k_pages, v_pages, page_table, context_lens,
                    k_scale=None, v_scale=None):
    """The same pair in f32: (a @ b, decode attention)."""
    return (matmul_reference(a, b),
            decode_attention_reference(q.astype(jnp.float32), k_pages, v_pages, page_table,
                                       context_lens, k_scale, v_scale))
