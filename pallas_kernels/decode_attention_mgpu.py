"""Paged grouped-query decode attention for a bounded grid, in Mosaic GPU (Hopper).

Why a second kernel: at a bounded grid (the resource share NanoFlow gives attention) the
Triton kernel stops far below copy bandwidth at half the SMs, because Triton issues the
gathered page loads too slowly; a TMA pipeline into shared memory streamed near copy speed
there (bench/results/load_probe_h200.json). This kernel keeps `stages` blocks of keys and
values in flight per worker with one TMA copy per (page, kv head) tile, two workers (warp
groups) per program (measured: bench/results/decode_attention_mgpu_h200.json,
bench/results/log/kernels.md; pallas_kernels/README.md says why).

Same contract and unit of work as decode_attention.py: the workers of a persistent grid
of `num_programs` programs stride over the B x KVH (sequence, kv head) units; each unit
serves its query group in one pass over the sequence's pages. The group's query rows
(padded to 8, a TMA tile) sit in the first rows of a 64-row WGMMA tile whose other rows
stay zero. Precondition: key/value slots past a sequence's length inside its last page
hold finite values (they get zero weight, but 0 x NaN is NaN); the engine's cache is
zero-initialised and only ever holds written keys and values.

Checked against the reference in Mosaic GPU's interpret mode on the CPU and compiled on
the H200 (tests/test_decode_attention_mgpu.py); timings in bench/results/log/kernels.md.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.device import device_sms
from pallas_kernels.mosaic_gpu_support import copy_pages_to_slot, interpret_params

_ROWS = 64  # WGMMA tile height
_QROWS = 8  # query rows copied per unit (the group, padded to a TMA tile)


def unsupported(q, k_pages) -> str | None:
    """Why this kernel cannot take these operands, or None when it can."""
    h, d = q.shape[1:]
    kvh, ps = k_pages.shape[1:3]
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q.dtype).name}: the WGMMA tiles here are 16-bit"
    if h // kvh > _QROWS:
        return f"query group of {h // kvh} heads exceeds {_QROWS} rows"
    if d % 64 or ps % 8:  # 128-byte swizzled WGMMA tiles, 8-row TMA tiles
        return f"head dim {d} must be a multiple of 64 and page size {ps} of 8"
    return None


def _wgmma_layout(x, reduced=False, *, interpret):
    """x in the WGMMA register layout (reduced: a row vector of it); the CPU interpreter
    has no register layouts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:
        return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1) if reduced
                             else plgpu.Layout.WGMMA)


def _key_iota(shape, *, interpret):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, 1)
    return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)


def _matmul_qk(q_smem, k_tile, *, interpret):
    """[ROWS, D] x [block_k, D]^T on the tensor cores -> [ROWS, block_k] f32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:  # the interpreter's wgmma takes no transposed operand
        return jnp.dot(q_smem[...], k_tile[...].T, preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC((_ROWS, k_tile.shape[0]), jnp.float32))


def _matmul_pv(p16, v_tile, *, interpret):
    """[ROWS, block_k] (registers) x [block_k, D] -> [ROWS, D] f32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:
        return jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_tile)
        return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC((_ROWS, v_tile.shape[1]), jnp.float32))


# jitted so that a step calling it once per layer lowers the kernel once per shape (jax
# caches the lowering of identical nested jits), not once per call. Inside a stream
# region the call is inlined (pipeline/streams.py).
@functools.partial(jax.jit, static_argnames=("num_programs", "block_k", "stages",
                                             "warpgroups", "approx_math", "interpret"))
def decode_attention_mgpu(q, k_pages, v_pages, page_table, context_lens, *,
                          num_programs: int | None = None, block_k: int = 64,
                          stages: int = 2, warpgroups: int = 2, approx_math: bool = True,
                          interpret: bool = False):
    """q [B, H, D]; pages [N, KVH, ps, D]; page_table [B, P]; context_lens [B] -> [B, H, D].

    num_programs: the persistent grid, one program per SM (None: every SM). Each program
    runs `warpgroups` independent workers (each its own units, ring and barriers): while
    one waits on a copy or a page number, the other computes. block_k keys per pipeline
    step (a multiple of the page size); stages steps in flight per worker. approx_math:
    the hardware exp2 (ex2.approx), as jax's own Mosaic GPU attention uses.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if (why := unsupported(q, k_pages)) is not None:
        raise ValueError(why)
    b, h, d = q.shape
    n, kvh, ps, _ = k_pages.shape
    g = h // kvh
    if block_k % ps or block_k % 64:  # whole pages; 64: the P x V matmul's K tile
        raise ValueError(f"block_k {block_k} must be a multiple of 64 and of the page "
                         f"size {ps}")
    if num_programs is None:
        num_programs = device_sms()
    ppb = block_k // ps
    pw = page_table.shape[1]
    if pw % ppb:  # whole blocks of page numbers (the tail, page 0, is never attended)
        page_table = lax.pad(page_table.astype(jnp.int32), jnp.int32(0),
                             [(0, 0, 0), (0, ppb - pw % ppb, 0)])
    table_blocks = page_table.shape[1] // ppb
    num_work = b * kvh
    nprog = max(1, min(num_programs, -(-num_work // warpgroups)))
    workers = nprog * warpgroups
    dtype = q.dtype
    qg = lax.pad(q.reshape(b, kvh, g, d), jnp.zeros((), dtype),  # lax.pad: no nested jit
                 [(0, 0, 0), (0, 0, 0), (0, _QROWS - g, 0), (0, 0, 0)])
    log2_scale = math.log2(math.e) / math.sqrt(d)  # exp(x / sqrt(d)) = exp2(x * this)

    wgmma_layout = functools.partial(_wgmma_layout, interpret=interpret)
    key_iota = functools.partial(_key_iota, interpret=interpret)
    matmul_qk = functools.partial(_matmul_qk, interpret=interpret)
    matmul_pv = functools.partial(_matmul_pv, interpret=interpret)

    def kernel(q_ref, k_ref, v_ref, pt_ref, len_ref, o_ref, q_smems, o_smems, k_smems,
               v_smems, q_bars, k_bars, v_bars):
        wg = lax.axis_index("wg") if warpgroups > 1 else 0
        worker = lax.axis_index("p") * warpgroups + wg
        q_smem, o_smem, k_smem, v_smem = (r.at[wg] for r in (q_smems, o_smems, k_smems,
                                                             v_smems))
        q_bar = q_bars.at[wg]
        bar0 = wg * stages  # this worker's copy barriers: one per slot
        q_smem[...] = wgmma_layout(jnp.zeros((_ROWS, d), dtype))
        plgpu.commit_smem()

        def unit(i, ctx):
            w = worker + i * workers
            bb, hh = w // kvh, w % kvh
            nb = (ctx + block_k - 1) // block_k
            # the next unit's length, loaded now so its latency hides behind this unit
            ctx_next = len_ref[jnp.minimum(w + workers, num_work - 1) // kvh]
            plgpu.copy_gmem_to_smem(q_ref.at[bb, hh], q_smem.at[pl.ds(0, _QROWS)], q_bar)

            def pages(j):  # block j's page numbers (a block past the table: any valid one)
                jj = jnp.minimum(j, table_blocks - 1)
                return tuple(pt_ref[bb, jj * ppb + p] for p in range(ppb))

            def issue(j, pgs):  # the copies of block j into its slot, one per page
                slot = lax.rem(j, stages)
                copy_pages_to_slot(k_ref, v_ref, k_smem.at[slot], v_smem.at[slot], pgs, hh,
                                   kvh, ps, k_bars.at[bar0 + slot], v_bars.at[bar0 + slot])

            for s in range(stages - 1):
                pl.when(s < nb)(functools.partial(lambda s: issue(s, pages(s)), s))
            plgpu.barrier_wait(q_bar)

            def step(j, carry, masked):
                acc, m, l, pgs = carry
                slot = lax.rem(j, stages)
                # block j + stages - 1 reuses the slot of block j - 1, finished last step;
                # its page numbers were loaded one step ago, the next ones load now
                pl.when(j + stages - 1 < nb)(lambda: issue(j + stages - 1, pgs))
                pgs = pages(j + stages)
                plgpu.barrier_wait(k_bars.at[bar0 + slot])
                s = matmul_qk(q_smem, k_smem.at[slot])
                if masked:  # only the last block holds keys past the context
                    key = key_iota((_ROWS, block_k)) + j * block_k
                    s = jnp.where(key < ctx, s, -jnp.inf)
                # m is the running max of raw scores; the scale rides in the exp2's FMA
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2((m - m_new) * log2_scale)
                p_ = jnp.exp2(s * log2_scale
                              - lax.broadcast_in_dim(m_new * log2_scale, s.shape, [0]))
                l = l * alpha + p_.sum(axis=1)
                plgpu.barrier_wait(v_bars.at[bar0 + slot])
                pv = matmul_pv(p_.astype(dtype), v_smem.at[slot])
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
                return acc, m_new, l, pgs

            carry = (wgmma_layout(jnp.zeros((_ROWS, d), jnp.float32)),
                     wgmma_layout(jnp.full((_ROWS,), -jnp.inf, jnp.float32), reduced=True),
                     wgmma_layout(jnp.zeros((_ROWS,), jnp.float32), reduced=True),
                     pages(stages - 1))
            last = jnp.maximum(nb - 1, 0)
            carry = lax.fori_loop(0, last, functools.partial(step, masked=False), carry)
            acc, m, l, _ = lax.fori_loop(last, nb, functools.partial(step, masked=True), carry)
            l = jnp.where(l > 0, l, 1.0)
            o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, _QROWS)], o_ref.at[bb, hh])
            plgpu.wait_smem_to_gmem(0)  # o_smem is rewritten by the next unit
            return ctx_next

        first = len_ref[jnp.minimum(worker, num_work - 1) // kvh]
        lax.fori_loop(0, (num_work - worker + workers - 1) // workers, unit, first)

    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    wgs = warpgroups
    scratch = [plgpu.SMEM((wgs, _ROWS, d), dtype, transforms=tiles),
               plgpu.SMEM((wgs, _ROWS, d), dtype, transforms=tiles),
               plgpu.SMEM((wgs, stages, block_k, d), dtype, transforms=tiles),
               plgpu.SMEM((wgs, stages, block_k, d), dtype, transforms=tiles),
               plgpu.Barrier(num_barriers=wgs),
               plgpu.Barrier(num_arrivals=ppb, num_barriers=wgs * stages),
               plgpu.Barrier(num_arrivals=ppb, num_barriers=wgs * stages)]
    threads = dict(num_threads=wgs, thread_name="wg") if wgs > 1 else {}
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((b, kvh, _QROWS, d), dtype),
        scratch_types=scratch, grid=(nprog,), grid_names=("p",), **threads,
        kernel_name="decode_attention_mgpu",  # in profiles: the kernel's name
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=approx_math),
        interpret=interpret_params() if interpret else None,
    )(qg, k_pages.reshape(n * kvh, ps, d), v_pages.reshape(n * kvh, ps, d),
      page_table.astype(jnp.int32), context_lens.astype(jnp.int32))
    return out[:, :, :g].reshape(b, h, d)
