"""Paged grouped-query decode attention for a bounded grid, in Mosaic GPU (Hopper).

Why a second kernel: at a bounded grid (the resource share NanoFlow gives attention) the
Triton kernel stops near 34% of copy bandwidth at half the SMs, because Triton issues the
gathered page loads too slowly; a TMA pipeline into shared memory streamed 96% there
(bench/results/load_probe_h200.json). This kernel keeps `stages` blocks of keys and
values in flight per program with one TMA copy per (page, kv head) tile.

Same contract and unit of work as decode_attention.py: a persistent grid of
`num_programs` programs strides over the B x KVH (sequence, kv head) units; each unit
serves its query group in one pass over the sequence's pages. The group's query rows
(padded to 8, a TMA tile) sit in the first rows of a 64-row WGMMA tile whose other rows
stay zero. Precondition: key/value slots past a sequence's length inside its last page
hold finite values (they get zero weight, but 0 x NaN is NaN); the engine's cache is
zero-initialised and only ever holds written keys and values.

Status: checked against the reference in Mosaic GPU's interpret mode on the CPU; not yet
compiled or measured on a GPU (issue 5).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_ROWS = 64  # WGMMA tile height
_QROWS = 8  # query rows copied per unit (the group, padded to a TMA tile)


def _interpret_params():
    """Mosaic GPU's CPU interpreter (a public name in newer jax, private in 0.10)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if hasattr(plgpu, "InterpretParams"):
        return plgpu.InterpretParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def decode_attention_mgpu(q, k_pages, v_pages, page_table, context_lens, *,
                          num_programs: int | None = None, block_k: int = 64,
                          stages: int = 4, interpret: bool = False):
    """q [B, H, D]; pages [N, KVH, ps, D]; page_table [B, P]; context_lens [B] -> [B, H, D].

    num_programs: the persistent grid, one program per SM (None: every SM). block_k keys
    per pipeline step (a multiple of the page size); stages steps in flight.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, h, d = q.shape
    n, kvh, ps, _ = k_pages.shape
    g = h // kvh
    if g > _QROWS:
        raise ValueError(f"query group of {g} heads exceeds {_QROWS} rows")
    if d % 64 or ps % 8:  # 128-byte swizzled WGMMA tiles, 8-row TMA tiles
        raise ValueError(f"head dim {d} must be a multiple of 64 and page size {ps} of 8")
    if block_k % ps:
        raise ValueError(f"block_k {block_k} is not a multiple of the page size {ps}")
    if num_programs is None:
        num_programs = getattr(jax.devices()[0], "core_count", None) or 132
    ppb = block_k // ps
    pw = page_table.shape[1]
    if pw % ppb:  # whole blocks of page numbers (the tail, page 0, is never attended)
        page_table = lax.pad(page_table.astype(jnp.int32), jnp.int32(0),
                             [(0, 0, 0), (0, ppb - pw % ppb, 0)])
    num_work = b * kvh
    nprog = max(1, min(num_programs, num_work))
    dtype = q.dtype
    qg = lax.pad(q.reshape(b, kvh, g, d), jnp.zeros((), dtype),  # lax.pad: no nested jit
                 [(0, 0, 0), (0, 0, 0), (0, _QROWS - g, 0), (0, 0, 0)])
    scale = 1.0 / math.sqrt(d)

    def wgmma_layout(x, reduced=False):  # register layouts; the CPU interpreter has none
        if interpret:
            return x
        return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1) if reduced
                                 else plgpu.Layout.WGMMA)

    def key_iota(shape):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, 1)
        return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)

    def matmul_qk(q_smem, k_tile):  # [ROWS, D] x [block_k, D]^T on the tensor cores
        if interpret:  # the interpreter's wgmma takes no transposed operand
            return jnp.dot(q_smem[...], k_tile[...].T, preferred_element_type=jnp.float32)

        def body(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
            return acc_ref[...]
        return pl.run_scoped(body, plgpu.ACC((_ROWS, block_k), jnp.float32))

    def matmul_pv(p16, v_tile):  # [ROWS, block_k] (registers) x [block_k, D]
        if interpret:
            return jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)

        def body(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_tile)
            return acc_ref[...]
        return pl.run_scoped(body, plgpu.ACC((_ROWS, d), jnp.float32))

    def kernel(q_ref, k_ref, v_ref, pt_ref, len_ref, o_ref, q_smem, o_smem, k_smem, v_smem,
               q_bar, k_bars, v_bars):
        pid = lax.axis_index("p")
        q_smem[...] = wgmma_layout(jnp.zeros((_ROWS, d), dtype))
        plgpu.commit_smem()

        def unit(i, carry):
            w = pid + i * nprog
            bb, hh = w // kvh, w % kvh
            ctx = len_ref[bb]
            nb = (ctx + block_k - 1) // block_k
            plgpu.copy_gmem_to_smem(q_ref.at[bb, hh], q_smem.at[pl.ds(0, _QROWS)], q_bar)

            def issue(j):  # the copies of block j into its slot, one per page
                slot = lax.rem(j, stages)
                for p in range(ppb):
                    row = pt_ref[bb, j * ppb + p] * kvh + hh
                    dst = pl.ds(p * ps, ps)
                    plgpu.copy_gmem_to_smem(k_ref.at[row], k_smem.at[slot, dst],
                                            k_bars.at[slot * ppb + p])
                    plgpu.copy_gmem_to_smem(v_ref.at[row], v_smem.at[slot, dst],
                                            v_bars.at[slot * ppb + p])

            for s in range(stages - 1):
                pl.when(s < nb)(functools.partial(issue, s))
            plgpu.barrier_wait(q_bar)

            def step(j, carry):
                acc, m, l = carry
                slot = lax.rem(j, stages)
                # block j + stages - 1 reuses the slot of block j - 1, finished last step
                pl.when(j + stages - 1 < nb)(lambda: issue(j + stages - 1))
                for p in range(ppb):
                    plgpu.barrier_wait(k_bars.at[slot * ppb + p])

                s = matmul_qk(q_smem, k_smem.at[slot]) * scale
                key = key_iota((_ROWS, block_k)) + j * block_k
                s = jnp.where(key < ctx, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp(m - m_new)
                p_ = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p_.sum(axis=1)
                for p in range(ppb):
                    plgpu.barrier_wait(v_bars.at[slot * ppb + p])

                pv = matmul_pv(p_.astype(dtype), v_smem.at[slot])
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
                return acc, m_new, l

            init = (wgmma_layout(jnp.zeros((_ROWS, d), jnp.float32)),
                    wgmma_layout(jnp.full((_ROWS,), -jnp.inf, jnp.float32), reduced=True),
                    wgmma_layout(jnp.zeros((_ROWS,), jnp.float32), reduced=True))
            acc, m, l = lax.fori_loop(0, nb, step, init)
            l = jnp.where(l > 0, l, 1.0)
            o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, _QROWS)], o_ref.at[bb, hh])
            plgpu.wait_smem_to_gmem(0)  # o_smem is rewritten by the next unit
            return carry

        lax.fori_loop(0, (num_work - pid + nprog - 1) // nprog, unit, ())

    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [plgpu.SMEM((_ROWS, d), dtype, transforms=tiles),
               plgpu.SMEM((_ROWS, d), dtype, transforms=tiles),
               plgpu.SMEM((stages, block_k, d), dtype, transforms=tiles),
               plgpu.SMEM((stages, block_k, d), dtype, transforms=tiles),
               plgpu.Barrier(num_barriers=1),
               plgpu.Barrier(num_barriers=stages * ppb),
               plgpu.Barrier(num_barriers=stages * ppb)]
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((b, kvh, _QROWS, d), dtype),
        scratch_types=scratch, grid=(nprog,), grid_names=("p",),
        interpret=_interpret_params() if interpret else None,
    )(qg, k_pages.reshape(n * kvh, ps, d), v_pages.reshape(n * kvh, ps, d),
      page_table.astype(jnp.int32), context_lens.astype(jnp.int32))
    return out[:, :, :g].reshape(b, h, d)
