"""Paged grouped-query decode attention with swapped operands ("swap AB"), in Mosaic GPU.

Same contract as decode_attention.py and decode_attention_mgpu.py: q [B, H, D], head-major
pages [N, KVH, ps, D], page_table [B, P], context_lens [B] -> [B, H, D]; `num_programs`
is the persistent grid, i.e. the SMs this kernel may occupy (its resource share).

Why this shape of kernel (the design choices; pallas_kernels/README.md has the measurements
that led here). A bounded grid must stream ~60 GB/s per SM (issue 17's target, 65% of
copy on 44 SMs): one 16 KB block of keys and values every ~500 cycles. The previous
kernel computed S = Q K^T on a 64-row WGMMA tile of which only the query group (4 rows)
is real, so every block paid a 64 x 64 softmax and a 64 x D rescale: an SM's rate was set
by arithmetic on padding. Here the operands are swapped, as TensorRT-LLM's XQA kernel
does on Hopper:

  * S^T = K Q^T: M = block_k keys, N = the query group padded to 8 (16, 24, 32 for larger
    groups), K = D. The softmax works on block_k x 8 scores: 4 per thread for 64 keys.
  * the max over keys is a reduction over rows, i.e. across the warpgroup's 4 warps: it
    goes through a small per-worker SMEM scratch (Mosaic's own reduction scratch sits at
    one fixed offset shared by every warpgroup of the block, so concurrent workers would
    race on it); the running sum stays an unreduced block_k x 8 array, reduced once per
    (sequence, kv head) at the end.
  * O^T = V^T P^T: M = D (two 64-row WGMMA groups), N = 8, K = block_k; V^T is the
    transposed view of the same 128-byte-swizzled V tile the TMA wrote (16-bit A may be
    MN-major), P is stored as [8, block_k] in a 128-byte-swizzled tile through a
    transposed view from the WGMMA_TRANSPOSED register layout (one shuffle), so both
    operands share the 128-byte swizzle and each page tile is 2 TMA boxes.
  * the accumulator is D x 8 f32: 8 registers a thread (against 64 before), so each
    program runs `warpgroups` (default 4) independent workers, each with its own ring of
    `stages` blocks, its own barriers and reduction scratch: while one waits on a copy or
    a WGMMA, the others compute, and 4 x 2-3 blocks x 16 KB = 128-192 KB of K and V are in
    flight per SM (the load probe needed 64 KB or more per SM to near copy speed at half
    the SMs: bench/results/load_probe_h200.json).
  * every worker streams its (sequence, kv head[, split]) items as one flat pipeline: the
    copies of the next item's first blocks are issued while the current item finishes,
    its query tile is double-buffered and its length and page numbers are loaded ahead,
    so there is no pipeline drain per item (at 44 programs an item is ~16 blocks; a drain
    per item would cost ~10%).
  * split-KV: when B x KVH items cannot fill the workers (B 16: 128 items for 132 x 4
    workers) each item's blocks are split into `splits` ranges; the kernel writes each
    range's normalised f32 output and its log-sum-exp, and a small XLA combine weights
    them. With splits == 1 the kernel writes the bf16 output itself.
  * the key mask is applied to every block (8 selects a thread: cheaper than a second
    loop), page numbers are clamped to the sequence's last page so no table entry past the
    context is dereferenced, and a block or split with no keys yields zeros, not NaN.

Precondition (as the other kernels): key/value slots past a sequence's length inside its
last page hold finite values (they get zero weight, but 0 x NaN is NaN); entries of the
page table past the last page are never read. The engine's cache is zero-initialised.

The CPU interpreter has no register layouts, no WGMMA with transposed operands and no
inline Mosaic GPU; in interpret mode the same loop runs with jnp matmuls and reductions.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.device import device_sms
from pallas_kernels.mosaic_gpu_support import copy_pages_to_slot, interpret_params

_MAX_GROUP = 32  # query heads per kv head (the WGMMA N dimension, padded to 8)


def unsupported(q, k_pages) -> str | None:
    """Why this kernel cannot take these operands, or None when it can."""
    h, d = q.shape[1:]
    kvh, ps = k_pages.shape[1:3]
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q.dtype).name}: the WGMMA tiles here are 16-bit"
    if jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.float8_e4m3fn):
        if d % 128:  # an 8-bit row of 128 bytes is one swizzled TMA tile
            return f"float8 pages need a head dim multiple of 128, not {d}"
    elif jnp.dtype(k_pages.dtype) != jnp.dtype(q.dtype):
        return f"pages of {jnp.dtype(k_pages.dtype).name} with a {jnp.dtype(q.dtype).name} query"
    if h % kvh or h // kvh > _MAX_GROUP:
        return f"query group of {h}/{kvh} heads: must divide and be <= {_MAX_GROUP}"
    if d % 64 or ps % 8 or 64 % ps:  # 128-byte swizzled tiles, 8-row TMA boxes
        return f"head dim {d} must be a multiple of 64 and page size {ps} one of 8/16/32/64"
    return None


def default_splits(batch: int, kv_heads: int, max_context: int, workers: int,
                   block_k: int = 64) -> int:
    """Key ranges per (sequence, kv head): 1 when B x KVH items give every worker one,
    else the count that minimises the busiest worker's blocks, ceil(items x S / workers)
    x (blocks / S + 2) (2: a range's fixed cost, its first copies and its output), with
    >= 4 blocks a range and at most 16 ranges."""
    items = batch * kv_heads
    if items >= workers:
        return 1
    blocks = -(-max_context // block_k)

    def busiest(s):
        return -(-items * s // workers) * (-(-blocks // s) + 2)
    return min(range(1, max(1, min(16, blocks // 4)) + 1), key=busiest)


def combine_splits(o_parts, lse_parts, splits_valid):
    """o_parts [B, KVH, S, D, N] f32 (each split normalised), lse_parts [B, KVH, S, N]
    (log2 domain), splits_valid [B, S] -> [B, KVH, N, D] f32."""
    lse = jnp.where(splits_valid[:, None, :, None], lse_parts, -jnp.inf)
    top = lse.max(axis=2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse - top)  # [B, KVH, S, N]
    o = jnp.where(splits_valid[:, None, :, None, None], o_parts, 0.0)
    num = jnp.einsum("bksn,bksdn->bknd", w, o)
    return num / jnp.maximum(w.sum(axis=2), 1e-30)[..., None]


def quantize_query_groups(q, kv_heads: int):
    """q [B, H, D] -> (e4m3 [B, H, D], scale f32 [B, KVH]): each (sequence, kv head)'s
    query group divided by its absmax / 448 (saturated: e4m3fn has no inf)."""
    b, h, d = q.shape
    qf = q.astype(jnp.float32).reshape(b, kv_heads, h // kv_heads, d)
    scale = jnp.maximum(jnp.max(jnp.abs(qf), axis=(2, 3)), 1e-12) / 448.0
    q8 = jnp.clip(qf / scale[:, :, None, None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q8.reshape(b, h, d), scale


class SwapABCall(NamedTuple):
    """One launch of the kernel, unlaunched, so that a fused kernel can run its programs
    (pallas_kernels/fused_gemm_attention_mgpu.py). body(program, *operand refs, *output
    refs, *scratch refs) is one program's work, program in [0, programs); every program
    allocates `scratch` (shared by its `warpgroups` warpgroups, axis "wg"); finish maps
    the outputs to [B, H, D]."""
    body: Callable
    operands: tuple
    out_type: Any
    scratch: list
    programs: int
    warpgroups: int
    finish: Callable


def longest_first(context_lens, num_rows=None):
    """The sequences by context length, longest first, rows past num_rows last: the order
    in which the workers take their (sequence, kv head) items, dealt in a snake (round r
    to workers 0, 1, ... when r is even, from the last worker back when odd), so each
    worker's total is near the mean even where lengths vary: round-robin over the rows as
    given left the busiest worker far more key blocks than the mean on the traces' batches
    (counted, and timed: bench/results/log/step.md)."""
    lens = context_lens.astype(jnp.int32)
    if num_rows is not None:
        lens = jnp.where(jnp.arange(lens.shape[0]) < num_rows, lens, -1)
    return jnp.argsort(-lens, stable=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "num_programs", "block_k", "stages", "warpgroups", "splits", "columns", "approx_math",
    "longest_first_order", "fp8_query", "interpret"))
def decode_attention_swapab(q, k_pages, v_pages, page_table, context_lens, *,
                            num_programs: int | None = None, block_k: int = 64,
                            stages: int | None = None, warpgroups: int | None = None,
                            splits: int | None = None, columns: int | None = None,
                            approx_math: bool = True, k_scale=None, v_scale=None,
                            num_rows=None, longest_first_order: bool = False,
                            order=None, fp8_query: bool = False, interpret: bool = False):
    """q [B, H, D]; pages [N, KVH, ps, D]; page_table [B, P]; context_lens [B] -> [B, H, D].

    num_programs: the persistent grid, one program per SM (None: every SM).
    warpgroups: independent workers per program; stages: blocks of block_k keys in
    flight per worker (None: 2 stages; 3 workers on a bounded grid, 2 on the full one,
    4 for float8 pages there without split-KV: the fastest at each on the H200;
    bench/results/decode_kernel/sweep_h200.json, bench/results/log/kernels.md and fp8.md).
    splits: key ranges per (sequence, kv head) combined afterwards (None: default_splits).
    columns: the WGMMA N, the query group padded (None: to a multiple of 8).
    approx_math: the hardware exp2, as jax's own attention uses.
    num_rows: a traced int32 scalar: only rows [0, num_rows) are attended; the others'
    outputs are left unspecified (the engine's decode call, whose prefill rows the
    chunked-prefill kernel serves). None: all B.
    longest_first_order: the workers take the sequences longest first (longest_first), not
    in row order (the engine's default, KernelConfig.decode_longest_first). order: that
    order already computed (int32 [B], longest_first of these context_lens and num_rows;
    given, it is used whatever longest_first_order says): a step's layers share one sort
    instead of one each (XLA does not merge them across the executor's stream regions:
    one sort per layer); None: sorted here where longest_first_order.

    float8_e4m3fn pages take per-kv-head float32 scales k_scale, v_scale [KVH] (real
    key = page value x k_scale[h]): each block is widened to f16 (exact), keys into
    registers (the WGMMA's A operand: no shared-memory round trip), values in shared
    memory (a transposed 8-bit tile does not load into registers), and multiplied in f16
    with the query in f16; scores are scaled by k_scale[h] inside
    the exp2's FMA and the output by v_scale[h].
    fp8_query (float8 pages only): the query quantized to e4m3 too, one scale per
    (sequence, kv head) (its group's absmax / 448), so S^T = K Q^T is an FP8 WGMMA on the
    key tile as the TMA wrote it: no widening of the keys at all; that scale joins
    k_scale[h] in the FMA. Costs the query's rounding (e4m3: 3 mantissa bits).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    call = swapab_call(q, k_pages, v_pages, page_table, context_lens,
                       num_programs=num_programs, block_k=block_k, stages=stages,
                       warpgroups=warpgroups, splits=splits, columns=columns,
                       k_scale=k_scale, v_scale=v_scale, num_rows=num_rows,
                       order=order if order is not None else (
                           longest_first(context_lens, num_rows) if longest_first_order
                           else None), fp8_query=fp8_query, interpret=interpret)
    wgs = call.warpgroups
    threads = dict(num_threads=wgs, thread_name="wg") if wgs > 1 else {}
    out = plgpu.kernel(
        lambda *refs: call.body(lax.axis_index("p"), *refs), out_type=call.out_type,
        scratch_types=call.scratch, grid=(call.programs,), grid_names=("p",), **threads,
        kernel_name="decode_attention_swapab",  # in profiles: the kernel's name
        compiler_params=None if interpret else compiler_params(approx_math),
        interpret=interpret_params() if interpret else None,
    )(*call.operands)
    return call.finish(out)


def compiler_params(approx_math: bool = True):
    """Lane semantics, as jax 0.10 defaults to: jax 0.11 defaults to Warpgroup, where this
    kernel's implicit broadcasts in selects do not lower."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.CompilerParams(approx_math=approx_math,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


def swapab_call(q, k_pages, v_pages, page_table, context_lens, *,
                num_programs: int | None = None, block_k: int = 64,
                stages: int | None = None, warpgroups: int | None = None,
                splits: int | None = None, columns: int | None = None,
                k_scale=None, v_scale=None, num_rows=None, order=None,
                fp8_query: bool = False, interpret: bool = False) -> SwapABCall:
    """The launch decode_attention_swapab makes (same arguments), unlaunched. order: int32
    [B], a permutation of the rows: the sequences in the order the workers take them
    (None: row order); with num_rows, its first num_rows entries must be those rows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if (why := unsupported(q, k_pages)) is not None:
        raise ValueError(why)
    b, h, d = q.shape
    n_pages, kvh, ps, _ = k_pages.shape
    g = h // kvh
    if block_k not in (64, 128) or block_k % ps:
        raise ValueError(f"block_k {block_k} must be 64 or 128 and a multiple of the page "
                         f"size {ps}")
    sms = device_sms()
    if num_programs is None:
        num_programs = sms
    fp8 = jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if warpgroups is None:  # FP8 on the full grid: 4 workers (a block is half the bytes;
        # faster than 2: bench/results/log/fp8.md) (without split-KV: the split
        # path's f32 outputs do not fit 4 workers' memory)
        big = fp8 and splits in (None, 1) and b * kvh >= 4 * num_programs
        warpgroups = (4 if big else 2) if num_programs >= sms else 3
    stages = 2 if stages is None else stages
    wgs = warpgroups
    ncol = columns or -(-g // 8) * 8  # the WGMMA N dimension: the group padded to 8
    if ncol % 8 or ncol < g or ncol > _MAX_GROUP:
        raise ValueError(f"columns {ncol}: a multiple of 8 from the group {g} to {_MAX_GROUP}")
    ppb = block_k // ps
    pw = page_table.shape[1]
    if splits is None:
        splits = default_splits(b, kvh, pw * ps, num_programs * wgs, block_k)
    items = b * kvh * splits
    nprog = max(1, min(num_programs, -(-items // wgs)))
    workers = nprog * wgs
    dtype = q.dtype
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("float8 pages need k_scale and v_scale, float32 [KVH]")
    if fp8_query and not fp8:
        raise ValueError("fp8_query quantizes the query for float8 pages only")
    mm_dtype = jnp.float16 if fp8 else dtype  # the WGMMA operands' type (P, widened V)
    q_dtype = k_pages.dtype if fp8_query else mm_dtype  # the query tile's
    scales = (jnp.ones((kvh,), jnp.float32) if k_scale is None
              else jnp.asarray(k_scale, jnp.float32).reshape(kvh),
              jnp.ones((kvh,), jnp.float32) if v_scale is None
              else jnp.asarray(v_scale, jnp.float32).reshape(kvh))
    # (sequence bb, kv head hh)'s query tile is rows [bb * H + hh * g, + ncol) of q as
    # [B * H, D]: its group, then the next heads' queries in the padding columns (past the
    # last row, the TMA's zero fill), whose scores and outputs are computed and dropped.
    # Columns never mix, so q needs no padded copy (that copy showed in the step's
    # profile: bench/results/log/step.md). The TMA needs B * H a multiple of its 8-row tile
    # (SmolLM2's 9 heads x 26 tokens did not lower): else q is padded per group. The
    # interpreter clamps a slice past the end instead: there q gets the rows.
    q_as_rows = (b * h) % 8 == 0
    q_scale = ()  # fp8_query: (sequence, kv head)'s query scale, [B * KVH] f32
    qs = q
    if fp8_query:
        q8, sq = quantize_query_groups(q, kvh)
        qs, q_scale = q8, (sq.reshape(b * kvh),)
    if q_as_rows:
        qg = qs.reshape(b * h, d).astype(q_dtype)
        if interpret and ncol > g:  # lax.pad: no nested jit (stream regions refuse them)
            qg = lax.pad(qg, jnp.zeros((), q_dtype), [(0, ncol - g, 0), (0, 0, 0)])
    else:
        qg = qs.reshape(b, kvh, g, d).astype(q_dtype)
        if ncol > g:
            qg = lax.pad(qg, jnp.zeros((), q_dtype),
                         [(0, 0, 0)] * 2 + [(0, ncol - g, 0), (0, 0, 0)])
    log2_scale = math.log2(math.e) / math.sqrt(d)  # exp(x / sqrt(d)) = exp2(x * this)
    red_elems = 32 * ncol * (block_k // 64)  # cross-warp reduction scratch per worker

    # -- register-level helpers: Mosaic GPU on the device, plain jnp in the interpreter --
    def layout(x, lay):
        return x if interpret else plgpu.layout_cast(x, lay)

    def key_iota(shape):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, 0)
        return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)

    def col_reduce(x, scratch, op):  # [rows, ncol] -> [ncol]: over keys, across warps
        if interpret:
            return x.max(axis=0) if op == "max" else x.sum(axis=0)  # op: "max" or "add"

        @plgpu.inline_mgpu(
            arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
            return_type=plgpu.ShapeDtypeStruct((ncol,), jnp.float32,
                                               plgpu.Layout.WGMMA.reduce(0)))
        def red(_, x, scratch_ref):
            return x.reduce(op, 0, scratch_ref)
        return red(x, scratch)

    def matmul_kq(k_tile, q_tile):  # S^T [block_k, ncol] = K [block_k, D] x Q^T
        if interpret:  # (float8 operands widened: exact, as the FP8 WGMMA's products)
            kk, qq = k_tile[...], q_tile[...]
            if fp8_query:
                kk, qq = kk.astype(jnp.float32), qq.astype(jnp.float32)
            return jnp.dot(kk, qq.T, preferred_element_type=jnp.float32)

        def body(acc_ref):
            plgpu.wgmma(acc_ref, k_tile, plgpu.transpose_ref(q_tile, (1, 0)))
            return acc_ref[...]
        return pl.run_scoped(body, plgpu.ACC((block_k, ncol), jnp.float32))

    def matmul_vp(acc, v_tile, p_tile):  # O^T [D, ncol] += V^T [D, block_k] x P^T
        if interpret:
            return acc + jnp.dot(v_tile[...].T, p_tile[...].T,
                                 preferred_element_type=jnp.float32)

        def body(acc_ref):
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_tile, (1, 0)),
                        plgpu.transpose_ref(p_tile, (1, 0)))
        return pl.run_state(body)(plgpu.ACC.init(acc))

    def store_transposed(tile_ref, x):  # tile_ref [ncol, X] <- x [X, ncol] (registers)
        if interpret:
            tile_ref[...] = x.T
        else:
            plgpu.transpose_ref(tile_ref, (1, 0))[...] = plgpu.layout_cast(
                x, plgpu.Layout.WGMMA_TRANSPOSED)

    def widen_to_registers(src):  # a float8 key tile -> f16 registers (exact): the A
        if interpret:               # operand of S^T = K Q^T straight from registers
            return src[...].astype(jnp.float16)
        return plgpu.load(src, (), layout=plgpu.Layout.WGMMA).astype(jnp.float16)

    def widen(src, dst):  # a float8 tile -> f16 in shared memory (exact), for the WGMMA
        if interpret:
            dst[...] = src[...].astype(jnp.float16)
        else:
            dst[...] = plgpu.load(src, (), layout=plgpu.Layout.WGMMA).astype(jnp.float16)
        plgpu.commit_smem()
        return dst

    def bcast_cols(v, shape):  # [ncol] -> shape [rows, ncol]
        return lax.broadcast_in_dim(v, shape, [1])

    # -- the work items: (sequence, kv head, split), and their blocks of keys --
    def item_coords(it):
        it = jnp.minimum(it, items - 1)
        bb = it // (kvh * splits)
        return bb, (it // splits) % kvh, it % splits

    def item_range(ctx, s):  # [first block, number of blocks >= 1) of split s
        nb = (ctx + block_k - 1) // block_k
        if splits == 1:
            return 0, jnp.maximum(nb, 1)
        chunk = (nb + splits - 1) // splits
        first = s * chunk
        return first, jnp.maximum(jnp.minimum(nb - first, chunk), 1)

    def snake_pos(rnd, worker):  # the worker's place in round rnd of a snake order
        return jnp.where(lax.rem(rnd, 2) == 0, worker, workers - 1 - worker)

    def kernel(program, q_ref, k_ref, v_ref, pt_ref, len_ref, rows_ref, ks_ref, vs_ref,
               *rest):
        qs_ref = None
        if fp8_query:
            qs_ref, *rest = rest
        ord_ref = None
        if order is not None:
            ord_ref, *rest = rest
        if splits == 1:
            o_ref, *rest = rest
        else:
            o_ref, lse_ref, *rest = rest
        q_smems, p_smems, o_smems, *rest = rest
        if splits > 1:
            lse_smems, *rest = rest
        red_smems, k_smems, v_smems, *rest = rest
        if fp8:
            v16s, *rest = rest
        q_bars, k_bars, v_bars = rest
        wg = lax.axis_index("wg") if wgs > 1 else 0
        worker = program * wgs + wg
        # this worker's items, of the first num_rows rows' (item order is row-major)
        live = jnp.clip(rows_ref[0], 0, b) * (kvh * splits)
        if ord_ref is None:  # round-robin: the worker's i-th item is worker + i x workers
            n_items = (live - worker + workers - 1) // workers
        else:  # snake: even rounds give the items to workers 0.., odd ones from the last
            # back, so with items longest first each worker's total is near the mean
            rounds = live // workers
            n_items = rounds + (snake_pos(rounds, worker) < live % workers).astype(jnp.int32)
        q_smem, p_smem, o_smem, red, k_smem, v_smem = (
            r.at[wg] for r in (q_smems, p_smems, o_smems, red_smems, k_smems, v_smems))
        lse_smem = lse_smems.at[wg] if splits > 1 else None
        if fp8:
            v16 = v16s.at[wg]
        qbar0, bar0 = wg * 2, wg * stages

        def row_of(bb):  # the q and output row of sequence bb (the lengths and the page
            # table come permuted by `order`: the per-block loads need no lookup)
            return bb if ord_ref is None else ord_ref[bb]

        def item_of(i):  # the worker's i-th item
            if ord_ref is None:
                return worker + i * workers
            return i * workers + snake_pos(i, worker)

        def load_q(i):  # item i's query tile into buffer i % 2
            bb, hh, _ = item_coords(item_of(i))
            bb = row_of(bb)
            src = q_ref.at[pl.ds(bb * h + hh * g, ncol)] if q_as_rows else q_ref.at[bb, hh]
            plgpu.copy_gmem_to_smem(src, q_smem.at[lax.rem(i, 2)],
                                    q_bars.at[qbar0 + lax.rem(i, 2)])

        def ctx_of(i):
            return len_ref[item_coords(item_of(i))[0]]

        def pages(i, j, ctx):  # page numbers of item i's block j (clamped to its last page)
            bb = item_coords(item_of(i))[0]
            last = jnp.maximum((ctx + ps - 1) // ps - 1, 0)
            return tuple(pt_ref[bb, jnp.minimum(j * ppb + p, last)] for p in range(ppb))

        def issue(t, i, pgs):  # step t's copies (item i) into slot t % stages
            hh = item_coords(item_of(i))[1]
            slot = lax.rem(t, stages)
            copy_pages_to_slot(k_ref, v_ref, k_smem.at[slot], v_smem.at[slot], pgs, hh, kvh,
                               ps, k_bars.at[bar0 + slot], v_bars.at[bar0 + slot])

        # The issue cursor runs stages - 1 steps ahead of the compute cursor, across item
        # boundaries. A cursor: (item i, block j, its last block + 1, the lengths of items
        # i, i + 1 and i + 2). Each scalar load is issued a step before its value is used.
        def cursor_start(i, ctx, ctx1, ctx2):
            first, nblk = item_range(ctx, item_coords(item_of(i))[2])
            return (i, first, first + nblk, ctx, ctx1, ctx2)

        def cursor_next(cur):
            i, j, end, ctx, ctx1, ctx2 = cur
            done = j + 1 == end
            nxt = cursor_start(i + 1, ctx1, ctx2, ctx2)
            cur = tuple(jnp.where(done, a, c) for a, c in zip(nxt, (i, j + 1, end, ctx, ctx1,
                                                                   ctx2)))
            return (*cur[:5], ctx_of(cur[0] + 2))

        def cursor_first():
            return cursor_start(0, ctx_of(0), ctx_of(1), ctx_of(2))

        @pl.when(n_items > 0)
        def _():
            load_q(0)
            pl.when(n_items > 1)(lambda: load_q(1))
            cur = cursor_first()
            for t in range(stages - 1):  # the prologue: the first stages - 1 blocks
                def pro(cur=cur, t=t):
                    issue(t, cur[0], pages(cur[0], cur[1], cur[3]))
                pl.when((cur[0] < n_items) & (cur[3] > 0))(pro)
                cur = cursor_next(cur)
            iss = cur
            comp = cursor_first()
            acc0 = layout(jnp.zeros((d, ncol), jnp.float32), plgpu.Layout.WGMMA)
            m0 = layout(jnp.full((ncol,), -jnp.inf, jnp.float32),
                        plgpu.Layout.WGMMA.reduce(0))
            l0 = layout(jnp.zeros((block_k, ncol), jnp.float32), plgpu.Layout.WGMMA)
            pgs0 = pages(iss[0], iss[1], iss[3])

            def cond(carry):
                return carry[1][0] < n_items

            def step(carry):
                t, comp, iss, pgs, acc, m, l = carry
                # issue: block t + stages - 1 reuses the slot of block t - 1 (done)
                # (a row with no keys, e.g. a prefill token in a decode call, loads nothing)
                pl.when((iss[0] < n_items) & (iss[3] > 0))(
                    lambda: issue(t + stages - 1, iss[0], pgs))
                iss = cursor_next(iss)
                pgs = pages(iss[0], iss[1], iss[3])
                i, j, end, ctx, *_ = comp
                qbuf = lax.rem(i, 2)
                first = item_range(ctx, item_coords(item_of(i))[2])[0]
                pl.when(j == first)(lambda: plgpu.barrier_wait(q_bars.at[qbar0 + qbuf]))
                slot = lax.rem(t, stages)
                # scores x log2(e) / sqrt(d) (x k_scale[h] for float8 keys, x the
                # query's scale for a float8 query), in the FMA
                c = log2_scale * ks_ref[item_coords(item_of(i))[1]] if fp8 else log2_scale
                if fp8_query:
                    qb, qh, _ = item_coords(item_of(i))
                    c = c * qs_ref[row_of(qb) * kvh + qh]

                def attend(acc, m, l):  # one block of keys
                    plgpu.barrier_wait(k_bars.at[bar0 + slot])
                    k_tile = (widen_to_registers(k_smem.at[slot]) if fp8 and not fp8_query
                              else k_smem.at[slot])
                    s = matmul_kq(k_tile, q_smem.at[qbuf])  # [block_k, ncol]
                    key = key_iota((block_k, ncol)) + j * block_k
                    s = jnp.where(key < ctx, s, -jnp.inf)
                    m_new = jnp.maximum(m, col_reduce(s, red, "max"))
                    m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0) * c
                    alpha = jnp.exp2(m * c - m_use)
                    p = jnp.exp2(s * c - bcast_cols(m_use, s.shape))
                    l = l * bcast_cols(alpha, l.shape) + p
                    acc = acc * bcast_cols(alpha, acc.shape)
                    store_transposed(p_smem, p.astype(mm_dtype))
                    plgpu.commit_smem()
                    plgpu.barrier_wait(v_bars.at[bar0 + slot])
                    v_tile = widen(v_smem.at[slot], v16) if fp8 else v_smem.at[slot]
                    return matmul_vp(acc, v_tile, p_smem), m_new, l

                acc, m_new, l = lax.cond(ctx > 0, attend, lambda *a: a, acc, m, l)
                last = j + 1 == end

                @pl.when(last)
                def _finish():
                    bb, hh, sp = item_coords(item_of(i))
                    bb = row_of(bb)
                    tot = col_reduce(l, red, "add")
                    o = acc / bcast_cols(jnp.where(tot > 0, tot, 1.0), acc.shape)
                    if fp8:
                        o = o * vs_ref[hh]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem is free
                    if splits == 1:
                        store_transposed(o_smem, o.astype(dtype))
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bb, hh])
                    else:
                        o_smem[...] = o
                        lse_smem[...] = m_new * c + jnp.log2(tot)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bb, hh, sp])
                        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bb, hh, sp])
                    # query buffer i % 2 is free: fetch item i + 2's
                    pl.when(i + 2 < n_items)(lambda: load_q(i + 2))

                acc = jnp.where(last, acc0, acc)
                m = jnp.where(last, m0, m_new)
                l = jnp.where(last, l0, l)
                comp = cursor_next(comp)
                return t + 1, comp, iss, pgs, acc, m, l

            lax.while_loop(cond, step, (jnp.int32(0), comp, iss, pgs0, acc0, m0, l0))
            plgpu.wait_smem_to_gmem(0)

    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    if splits == 1:
        out_type = jax.ShapeDtypeStruct((b, kvh, ncol, d), dtype)
        o_scratch = [plgpu.SMEM((wgs, ncol, d), dtype, transforms=tiles)]
    else:
        out_type = (jax.ShapeDtypeStruct((b, kvh, splits, d, ncol), jnp.float32),
                    jax.ShapeDtypeStruct((b, kvh, splits, ncol), jnp.float32))
        o_scratch = [plgpu.SMEM((wgs, d, ncol), jnp.float32),
                     plgpu.SMEM((wgs, ncol), jnp.float32)]
    kv_dtype, kv_tiles = dtype, tiles
    if fp8:  # 8-bit rows of 128 bytes; the widened f16 copy of V is a WGMMA tile (K goes
        kv_dtype = k_pages.dtype  # to the WGMMA from registers)
        kv_tiles = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
        o_scratch += [plgpu.SMEM((wgs, block_k, d), jnp.float16, transforms=tiles)]
    q_tiles = kv_tiles if fp8_query else tiles  # an 8-bit query row is 128 bytes too
    scratch = [plgpu.SMEM((wgs, 2, ncol, d), q_dtype, transforms=q_tiles),
               plgpu.SMEM((wgs, ncol, block_k), mm_dtype, transforms=tiles),
               *o_scratch[:2 if splits > 1 else 1],
               plgpu.SMEM((wgs, red_elems), jnp.float32),
               plgpu.SMEM((wgs, stages, block_k, d), kv_dtype, transforms=kv_tiles),
               plgpu.SMEM((wgs, stages, block_k, d), kv_dtype, transforms=kv_tiles),
               *o_scratch[2 if splits > 1 else 1:],
               plgpu.Barrier(num_barriers=wgs * 2),
               plgpu.Barrier(num_arrivals=ppb, num_barriers=wgs * stages),
               plgpu.Barrier(num_arrivals=ppb, num_barriers=wgs * stages)]
    # with an order the kernel sees the lengths and the page table in that order (one
    # gather here), and maps back to q's and the output's rows once per item
    seq_pt, seq_lens = ((page_table, context_lens) if order is None
                        else (page_table[order], context_lens[order]))
    operands = (qg, k_pages.reshape(n_pages * kvh, ps, d),
                v_pages.reshape(n_pages * kvh, ps, d), seq_pt.astype(jnp.int32),
                seq_lens.astype(jnp.int32),
                jnp.full((1,), b if num_rows is None else num_rows, jnp.int32), *scales,
                *q_scale, *(() if order is None else (order.astype(jnp.int32),)))

    def finish(out):
        if splits == 1:
            return out[:, :, :g].reshape(b, h, d)
        o_parts, lse_parts = out
        nb = (context_lens.astype(jnp.int32) + block_k - 1) // block_k
        chunk = (nb + splits - 1) // splits
        valid = jnp.arange(splits)[None, :] * chunk[:, None] < jnp.maximum(nb, 1)[:, None]
        o = combine_splits(o_parts, lse_parts, valid)
        return o[:, :, :g].reshape(b, h, d).astype(dtype)
    return SwapABCall(kernel, operands, out_type, scratch, nprog, wgs, finish)
