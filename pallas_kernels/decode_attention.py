"""Paged grouped-query decode attention: a Pallas kernel and its pure-JAX reference.

Layout: KV pages are [num_pages, KVH, page_size, D] (head-major inside a page), so the
rows of one (page, kv head) are contiguous. A unit of work is one (sequence, kv head): it
serves every query head of that group with one pass over the sequence's pages. The grid
is persistent: `num_programs` programs (the resource share R of NanoFlow) stride over the
B x KVH units, so the kernel occupies a bounded part of the GPU and a concurrent GEMM can
have the rest.

FP8 pages (float8_e4m3fn, stored as x / scale with one float32 scale per kv head for k and
for v): the kernel loads the 1-byte rows and widens them in registers, to f16 by default
(`fp8_compute`; the query is cast to it too; f32 queries keep f32): e4m3 widens to f16 in one conversion
instruction on Hopper, where bf16 takes a detour through f32 (with bf16 arithmetic the
H200 ran FP8 pages well below copy speed: bench/results/log/step.md); f16 holds every
e4m3 value exactly. The k scale is folded into the query (so into the scores) and the v
scale into the output, so the bytes read per key halve. Pages of another dtype than the
query's (bf16 pages under f32 queries) are converted to the query's dtype the same way.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt  # masked loads and stores

from pallas_kernels.device import device_sms

_NEG = -1e30
_MIN_ROWS = 16  # tl.dot needs at least 16 rows: the query group is padded up to this


def padded_rows(n: int) -> int:
    """Query rows of a program, n padded: at least _MIN_ROWS and a power of 2 (Pallas'
    Triton lowering takes no other array sizes: a group of 3 heads x 16 tokens, 48 rows,
    did not lower)."""
    return max(_MIN_ROWS, 1 << (n - 1).bit_length())


def decode_attention_reference(q, k_pages, v_pages, page_table, context_lens, k_scale=None,
                               v_scale=None):
    """q [B, H, D]; pages [N, KVH, ps, D]; page_table [B, P]; context_lens [B] -> [B, H, D].
    Computed in f32. k_scale, v_scale [KVH]: the scales of FP8 pages (page * scale is the
    value), or None."""
    b, h, d = q.shape
    n, kvh, ps, _ = k_pages.shape
    g = h // kvh
    k = k_pages[page_table].transpose(0, 2, 1, 3, 4).reshape(b, kvh, -1, d)  # [B,KVH,P*ps,D]
    v = v_pages[page_table].transpose(0, 2, 1, 3, 4).reshape(b, kvh, -1, d)
    qg = q.reshape(b, kvh, g, d).astype(jnp.float32) / math.sqrt(d)
    if k_scale is not None:
        qg = qg * k_scale.astype(jnp.float32)[None, :, None, None]
    s = jnp.einsum("bkgd,bksd->bkgs", qg, k.astype(jnp.float32))
    mask = jnp.arange(k.shape[2])[None, :] < context_lens[:, None]
    s = jnp.where(mask[:, None, None, :], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    v = jnp.where(mask[:, None, :, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("bkgs,bksd->bkgd", p, v)
    if v_scale is not None:
        o = o * v_scale.astype(jnp.float32)[None, :, None, None]
    return o.reshape(b, h, d).astype(q.dtype)


def _kernel(*refs, kvh, num_work, num_programs, pages_per_block, page_size, scale, prefetch,
            scaled, fp8_compute, token_rows):
    q_ref, k_ref, v_ref, pt_ref, len_ref, rowpos_ref, *refs = refs
    if token_rows:  # units of consecutive tokens, read and written in place
        blk_ref, *refs = refs
        refs = refs[:-2] + refs[-1:]  # (the aliased input is the output)
    if scaled:  # FP8 pages: per-kv-head scales of k and v
        ks_ref, vs_ref, o_ref = refs
    else:
        (o_ref,) = refs
    # pages of another dtype are converted to the compute dtype in registers
    # (f32 queries, the CPU's, keep f32 arithmetic)
    cd = (jnp.dtype(fp8_compute) if scaled and jnp.dtype(q_ref.dtype).itemsize == 2
          else q_ref.dtype)
    convert = k_ref.dtype != cd
    pid = pl.program_id(0)
    d = q_ref.shape[3]
    rows = token_rows * q_ref.shape[2] if token_rows else q_ref.shape[2]
    block_k = pages_per_block * page_size
    n_units = (num_work - pid + num_programs - 1) // num_programs

    def rows_of(b, h):
        """Unit b's query rows for kv head h: q_ref[b, h], or with token_rows the tokens
        of block b ([first, first + count) of q_ref [T, KVH, G, D]; masked past count:
        the next block's or past T) as token-major rows, and their mask."""
        if not token_rows:
            return (b, h), None
        first, count = blk_ref[b, 0], blk_ref[b, 1]
        tok = jnp.arange(token_rows)  # (and inside T: a block is never to cross its end)
        mask = ((tok < count) & (first + tok < q_ref.shape[0]))[:, None, None]
        return (pl.ds(first, token_rows), h, slice(None), slice(None)), mask

    def load_q(b, h):
        idx, mask = rows_of(b, h)
        if mask is None:
            return q_ref[idx]
        return plt.load(q_ref.at[idx], mask=mask, other=0).reshape(rows, d)

    def store_o(b, h, o):
        idx, mask = rows_of(b, h)
        if mask is None:
            o_ref[idx] = o.astype(o_ref.dtype)
        else:
            plt.store(o_ref.at[idx], o.reshape(token_rows, rows // token_rows, d)
                      .astype(o_ref.dtype), mask=mask)

    def unit(i, carry):
        w = pid + i * num_programs
        b, h = w // kvh, w % kvh
        ctx = len_ref[b]
        last = rowpos_ref[b]  # [rows]: the last key position each row may see
        if scaled:  # the k scale folded into the query: scores come out scaled
            q = (load_q(b, h).astype(jnp.float32) * (scale * ks_ref[h])).astype(cd)
        else:
            q = load_q(b, h) * scale  # [rows, D]
        n_blocks = (ctx + block_k - 1) // block_k

        def pages_of(j):  # clamped: a look-ahead past the last block rereads it (cached)
            j = jnp.maximum(jnp.minimum(j, n_blocks - 1), 0)
            return pt_ref[b, pl.ds(j * pages_per_block, pages_per_block)]

        def kv_of(pages):
            idx = pages * kvh + h  # rows of the [N * KVH, ps, D] view
            return k_ref[idx].reshape(block_k, d), v_ref[idx].reshape(block_k, d)

        def attend(j, k, v, o, m, l):
            if convert:  # here, not at the load: a prefetched block stays 1-byte
                k, v = k.astype(cd), v.astype(cd)
            s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [rows, block_k]
            key_pos = j * block_k + jnp.arange(block_k)
            s = jnp.where(key_pos[None, :] <= last[:, None], s, _NEG)
            valid = key_pos < ctx
            v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # stale pages may hold NaN
            m_new = jnp.maximum(m, s.max(axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l = l * alpha + p.sum(axis=-1)
            o = o * alpha[:, None] + jnp.dot(p.astype(v.dtype), v,
                                            preferred_element_type=jnp.float32)
            return o, m_new, l

        init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        if prefetch:
            # Software pipelining by hand: block j+1's keys and values, and block j+2's
            # page numbers, are loaded before block j is computed, so one program keeps
            # two blocks of bytes in flight and no page-table load sits on the data path.
            def block(j, carry):
                o, m, l, k, v, nxt = carry
                k_next, v_next = kv_of(nxt)
                nxt2 = pages_of(j + 2)
                o, m, l = attend(j, k, v, o, m, l)
                return o, m, l, k_next, v_next, nxt2

            k0, v0 = kv_of(pages_of(0))
            o, m, l, *_ = lax.fori_loop(0, n_blocks, block, (*init, k0, v0, pages_of(1)))
        else:
            def block(j, carry):
                return attend(j, *kv_of(pages_of(j)), *carry)

            o, m, l = lax.fori_loop(0, n_blocks, block, init)
        if scaled:
            o = o * vs_ref[h]
        store_o(b, h, o / jnp.maximum(l, 1e-30)[:, None])
        return carry

    lax.fori_loop(0, n_units, unit, ())


BLOCK_KEYS = 64  # keys per inner step, whatever the grid (see _use_prefetch)
# Triton addresses a page pool with int32 element offsets: a pool of 2^31 elements or more
# per layer wraps them (on the H200 an FP8 pool of 262,144 pages faulted; bf16 read
# garbage silently). 2^31 elements is 131,072 pages of 16 x 8 heads x 128.
MAX_POOL_ELEMENTS = 2**31 - 1


def pool_too_large(k_pages) -> str | None:
    """Why this kernel cannot address the pool (None when it can)."""
    n = math.prod(k_pages.shape)
    if n > MAX_POOL_ELEMENTS:
        return (f"a KV page pool of {k_pages.shape} holds {n:,} elements per layer; the "
                f"Triton attention kernels address it with int32 offsets (at most "
                f"{MAX_POOL_ELEMENTS:,}): use fewer pages")
    return None


def _use_prefetch(programs: int) -> bool:
    """Hand prefetch at two programs per SM or fewer: with 64-key blocks it lifts the
    bounded grids' share of copy bandwidth (as much as 128- or 256-key blocks gave) and
    costs some on a full grid (measured at batch 512, context 1024:
    bench/results/decode_attention_variants_h200.json, bench/results/log/kernels.md). The
    block stays 64 keys for every grid so that every share sums in the same order: the
    pipeline's ablation modes and plans with different shares give bitwise the same
    attention output. The engine's KernelConfig.decode_prefetch forces it off or on (A/B
    runs)."""
    return programs <= 2 * device_sms()


def paged_attention_call(qg, k_pages, v_pages, page_table, context_lens, row_last, *,
                         k_scale=None, v_scale=None, num_programs: int | None = None, pages_per_block: int | None = None,
                         num_warps: int | None = None, num_stages: int = 2,
                         prefetch: bool | None = None, interpret: bool = False,
                         fp8_compute: str = "float16", token_blocks=None, out=None):
    """The kernel over units of (query group, kv head), shared by decode and prefill.

    qg [B, KVH, rows, D]: the query rows of unit b for kv head h; page_table [B, P];
    context_lens [B]: keys the unit reads; row_last [B, rows]: the last key position each
    row may see (causal masking; decode rows see the whole context); k_scale, v_scale
    [KVH]: FP8 pages' scales (both or neither). -> [B, KVH, rows, D]

    In place (token_blocks [B, 2] and out): unit b is the tokens [first, first + count) of
    token_blocks[b], at most R of them (rows = R x G, a power of 2); qg [T, KVH, G, D] is
    the tokens' queries, read where they are, and their outputs are written into out
    [T, KVH, G, D] (aliased), which is returned with its other rows as they were. No
    gather of the queries into units and no scatter of the units' outputs back.
    """
    if token_blocks is None:
        b, kvh, rows, d = qg.shape
        token_rows = 0
    else:
        b = token_blocks.shape[0]
        _, kvh, g, d = qg.shape
        rows = row_last.shape[1]
        token_rows = rows // g
        assert token_rows * g == rows == padded_rows(rows) and out.shape == qg.shape
    n, _, ps, _ = k_pages.shape
    if (why := pool_too_large(k_pages)) is not None:
        raise ValueError(why)
    num_work = b * kvh
    nprog = num_work if num_programs is None else max(1, min(num_programs, num_work))
    if prefetch is None:
        prefetch = _use_prefetch(nprog)
    pages_per_block = pages_per_block or max(1, BLOCK_KEYS // ps)
    num_warps = num_warps or 4
    pw = page_table.shape[1]
    pad = -pw % pages_per_block
    if pad:  # lax.pad, not jnp.pad (a nested jit, refused inside stream-annotated regions)
        page_table = lax.pad(page_table.astype(jnp.int32), jnp.int32(0),
                             [(0, 0, 0), (0, pad, 0)])
    kern = functools.partial(_kernel, kvh=kvh, num_work=num_work, num_programs=nprog,
                             pages_per_block=pages_per_block, page_size=ps,
                             scale=1.0 / math.sqrt(d), prefetch=prefetch,
                             scaled=k_scale is not None, fp8_compute=fp8_compute,
                             token_rows=token_rows)
    args = [qg, k_pages.reshape(n * kvh, ps, d), v_pages.reshape(n * kvh, ps, d),
            page_table.astype(jnp.int32), context_lens.astype(jnp.int32),
            row_last.astype(jnp.int32)]
    if token_rows:
        args.append(token_blocks.astype(jnp.int32))
    if k_scale is not None:
        args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)
    if token_rows:
        params["input_output_aliases"] = {len(args): 0}
        args.append(out)
        out_shape = jax.ShapeDtypeStruct(out.shape, out.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((b, kvh, rows, d), qg.dtype)
    return pl.pallas_call(
        kern, grid=(nprog,), name="paged_decode_attention",  # named in profiles
        out_shape=out_shape, interpret=interpret, **params)(*args)


def decode_attention_impl(q, k_pages, v_pages, page_table, context_lens, *,
                          k_scale=None, v_scale=None, num_programs: int | None = None, pages_per_block: int | None = None,
                          num_warps: int | None = None, num_stages: int = 2,
                          prefetch: bool | None = None, interpret: bool = False,
                          fp8_compute: str = "float16"):
    """Pallas paged decode attention; same contract as decode_attention_reference.

    num_programs: programs in the persistent grid (None: one per unit of work).
    pages_per_block, num_warps: pages loaded per inner step (None: BLOCK_KEYS of keys) and
        warps per program (None: 4).
    prefetch: load block j+1 (and block j+2's page numbers) before computing block j
        (None: on for bounded grids, see _use_prefetch). The result does not depend on it.
    fp8_compute: the dtype FP8 pages are widened to (and a 16-bit query cast to) for the
        dots.
    """
    b, h, d = q.shape
    kvh = k_pages.shape[1]
    g = h // kvh
    rows = padded_rows(g)
    qg = q.reshape(b, kvh, g, d)
    if rows > g:  # lax.pad: see paged_attention_call
        qg = lax.pad(qg, jnp.zeros((), qg.dtype), [(0, 0, 0), (0, 0, 0), (0, rows - g, 0),
                                                   (0, 0, 0)])
    row_last = lax.broadcast_in_dim(context_lens.astype(jnp.int32) - 1, (b, rows), (0,))
    out = paged_attention_call(qg, k_pages, v_pages, page_table, context_lens, row_last,
                               k_scale=k_scale, v_scale=v_scale, num_programs=num_programs, pages_per_block=pages_per_block,
                               num_warps=num_warps, num_stages=num_stages,
                               prefetch=prefetch, interpret=interpret,
                               fp8_compute=fp8_compute)
    return out[:, :, :g].reshape(b, h, d)


# Jitted entry point. Inside a larger jitted step (and inside stream-annotated regions,
# which refuse nested jits) call decode_attention_impl instead.
decode_attention = jax.jit(decode_attention_impl, static_argnames=(
    "num_programs", "pages_per_block", "num_warps", "num_stages", "prefetch", "interpret",
    "fp8_compute"))
