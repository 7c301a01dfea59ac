"""The attention interface between a decoder layer and whatever stores the KV cache.

A layer hands its backend the unrotated q, k, v of the packed tokens; the backend applies
RoPE, stores k and v, and returns the attention output and the new cache of that layer.
This is where the GPU Pallas kernels (fused RoPE + append, paged decode attention,
chunked-prefill attention) plug in; the pure-JAX backends below are the references.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import KernelConfig
from nanojax.layers.kv_fp8 import is_fp8, kv_parts, quantize, with_pages
from nanojax.layers.rotary import apply_rope

NEG_INF = -1e30


class Attention(Protocol):
    """What a decoder layer calls: store this step's keys and values, attend."""

    def __call__(self, q, k, v, kv_layer, meta, inv_freq: np.ndarray):
        """q: [T, H, D], k/v: [T, KVH, D] -> (out [T, H, D], new kv_layer)."""


class AttentionBackend(Attention, Protocol):
    """The engine's attention over the paged cache, in two halves (append, then attend)
    so that the nano-batch executor can run an attention nano-op that only reads."""

    prefill_block_q: int | None  # query block of the chunked-prefill kernel, if it runs
    prefill_max_seqs: int  # with it: most sequences prefilling in one iteration
    width_free: bool  # attend's cost follows the longest context, not the table's width

    def append(self, k, v, kv_layer, meta, inv_freq):
        """RoPE on k, then k and v written into their pages -> the new kv_layer."""

    def attend(self, q, kv_layer, meta, inv_freq):
        """Attention of q over pages that already hold this step's keys."""

    def attend_at(self, share: float, num_sms: int = 132, ctas_per_sm: int = 4) -> Callable:
        """attend limited to a share of the GPU (where the kernel has a bounded grid)."""

    def prepare(self, meta):
        """meta with what every layer's attend reads of it computed once per step, before
        the layers (the swap-AB decode kernel's longest-first order). A forward calls it on
        each batch (nano-batch) it attends."""


def _softmax_attend(q, keys, values, mask, k_scale=None, v_scale=None):
    """q [T, H, D]; keys/values [T, L, KVH, D] (per-token key set); mask [T, L].
    k_scale, v_scale [KVH]: FP8 pages' scales (the k scale multiplies the scores, the v
    scale the output)."""
    t, h, d = q.shape
    kvh = keys.shape[2]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32) * (d ** -0.5)
    if k_scale is not None:
        qg = qg * k_scale[None, :, None, None]
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, keys.astype(jnp.float32))
    scores = jnp.where(mask[:, None, None, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, values.astype(jnp.float32))
    if v_scale is not None:
        out = out * v_scale[None, :, None, None]
    return out.reshape(t, h, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------
# Contiguous cache, one sequence: the plain reference path (no paging).
# ---------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ContiguousMetadata:
    positions: jax.Array  # [T] absolute positions of the tokens (also their cache slots)


def init_contiguous_cache(cfg, max_len: int, dtype):
    shape = (max_len, cfg.num_kv_heads, cfg.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def contiguous_attention(q, k, v, kv_layer, meta: ContiguousMetadata, inv_freq):
    q = apply_rope(q, meta.positions, inv_freq)
    k = apply_rope(k, meta.positions, inv_freq)
    k_cache, v_cache = kv_layer
    k_cache = k_cache.at[meta.positions].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[meta.positions].set(v.astype(v_cache.dtype))
    max_len = k_cache.shape[0]
    mask = jnp.arange(max_len)[None, :] <= meta.positions[:, None]
    t = q.shape[0]
    keys = jnp.broadcast_to(k_cache[None], (t,) + k_cache.shape)
    values = jnp.broadcast_to(v_cache[None], (t,) + v_cache.shape)
    return _softmax_attend(q, keys, values, mask), (k_cache, v_cache)


# ---------------------------------------------------------------------------------------
# Paged cache: pages are [num_pages, KVH, page_size, D] (head-major within a page).
# ---------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedMetadata:
    """Describes one packed batch: decode tokens first, then prefill chunks, then padding."""

    positions: jax.Array     # [T] int32 position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32 page * page_size + offset; -1 for padding
    seq_ids: jax.Array       # [T] int32 row of page_table the token belongs to
    page_table: jax.Array    # [S, P] int32 pages of each sequence of the batch
    context_lens: jax.Array  # [S] int32 tokens in the cache once this step is written
    num_decodes: jax.Array   # [] int32 tokens [0, num_decodes) are single-token decodes
    # for the chunked-prefill kernel (None without it), see prefill_metadata
    prefill_blocks: jax.Array | None = None  # [NB, 3] int32 first token, tokens, row
    prefill_slot: jax.Array | None = None    # [T] int32 block * block_q + offset
    # the rows in the order the decode kernel's workers take them (None: it orders them
    # itself), set by the backend's prepare once per step
    decode_order: jax.Array | None = None    # [T] int32


def prefill_metadata(seq_ids: np.ndarray, positions: np.ndarray, num_decodes: int,
                     num_tokens: int, block_q: int, max_seqs: int):
    """Query blocks of the prefill tokens [num_decodes, num_tokens) (host side), with a
    block count fixed by the batch's shape, T // block_q + max_seqs (each prefilling
    sequence adds at most one partial block), so shapes stay bucketed."""
    from pallas_kernels.prefill_attention import query_blocks
    t = len(seq_ids)
    blocks, slot = query_blocks(seq_ids[num_decodes:num_tokens],
                                positions[num_decodes:num_tokens], block_q,
                                max_blocks=t // block_q + max_seqs)
    blocks[:, 0] += num_decodes
    full = np.zeros(t, np.int32)
    full[num_decodes:num_tokens] = slot
    return blocks, full


def slice_metadata(meta: PagedMetadata, a: int, b: int) -> PagedMetadata:
    """The metadata of tokens [a, b) of the batch (a nano-batch). Query blocks are
    re-based; blocks outside [a, b) are emptied (a block never straddles a nano-batch
    boundary: the scheduler ends chunks there)."""
    blocks = meta.prefill_blocks
    if blocks is not None:
        inside = (blocks[:, 0] >= a) & (blocks[:, 0] < b)
        blocks = jnp.stack([jnp.clip(blocks[:, 0] - a, 0, b - a - 1),
                            jnp.where(inside, blocks[:, 1], 0), blocks[:, 2]], axis=1)
    return dataclasses.replace(
        meta, positions=meta.positions[a:b], slot_mapping=meta.slot_mapping[a:b],
        seq_ids=meta.seq_ids[a:b],
        num_decodes=jnp.clip(meta.num_decodes - a, 0, b - a),
        prefill_blocks=blocks,
        prefill_slot=None if meta.prefill_slot is None else meta.prefill_slot[a:b],
        decode_order=None)  # the whole batch's: prepare the slice again


def write_kv_pages(k_pages, v_pages, k, v, slot_mapping, k_scale=None, v_scale=None):
    """Scatter k, v [T, KVH, D] into their pages; slots < 0 are dropped. With scales
    (FP8 pages) the stored values are x / scale, saturated (layers/kv_fp8.py)."""
    num_pages, _, page_size, _ = k_pages.shape
    if k_scale is not None:
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    # lax.div/rem rather than // and %: jnp's versions are nested jits, which XLA refuses
    # inside stream-annotated regions; slots are non-negative where they are used
    page = jnp.where(slot_mapping >= 0, jax.lax.div(slot_mapping, page_size), num_pages)
    off = jax.lax.rem(jnp.maximum(slot_mapping, 0), page_size)
    k_pages = k_pages.at[page, :, off].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, :, off].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


def gather_sequence_kv(pages, page_table_rows):
    """pages [N, KVH, ps, D], rows [T, P] -> [T, P * ps, KVH, D] in position order."""
    g = pages[page_table_rows]  # [T, P, KVH, ps, D]
    t, p, kvh, ps, d = g.shape
    return g.transpose(0, 1, 3, 2, 4).reshape(t, p * ps, kvh, d)


def paged_attention_reference(q, k_pages, v_pages, meta: PagedMetadata, k_scale=None,
                              v_scale=None):
    """Each token attends to its own sequence's cached keys up to its position (causal)."""
    rows = meta.page_table[meta.seq_ids]
    keys = gather_sequence_kv(k_pages, rows)
    values = gather_sequence_kv(v_pages, rows)
    key_pos = jnp.arange(keys.shape[1])
    mask = key_pos[None, :] <= meta.positions[:, None]
    return _softmax_attend(q, keys, values, mask, k_scale, v_scale)


def append_kv(k, v, kv_layer, meta: PagedMetadata, inv_freq):
    """RoPE on the new keys, then write k and v into their pages (the step's KV append)."""
    k = apply_rope(k, meta.positions, inv_freq)
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    return with_pages(kv_layer, *write_kv_pages(k_pages, v_pages, k, v, meta.slot_mapping,
                                                 ks, vs))


def append_kv_pallas(k, v, kv_layer, meta: PagedMetadata, inv_freq, interpret=False):
    """The same append as one Pallas kernel (pallas_kernels/rope_append.py), where the
    kernel takes the shapes (else append_kv: e.g. SmolLM2's 3 kv heads)."""
    from pallas_kernels.rope_append import rope_append_impl, unsupported
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    if unsupported(k, k_pages) is not None:
        return append_kv(k, v, kv_layer, meta, inv_freq)
    return with_pages(kv_layer, *rope_append_impl(
        k, v, k_pages, v_pages, meta.positions, meta.slot_mapping, inv_freq,
        k_scale=ks, v_scale=vs, interpret=interpret))


def attend_reference(q, kv_layer, meta: PagedMetadata, inv_freq):
    """Pure-JAX attention over pages that already hold this step's keys (CPU path)."""
    q = apply_rope(q, meta.positions, inv_freq)
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    return paged_attention_reference(q, k_pages, v_pages, meta, ks, vs)


def _online_step(carry, scores, values, contract: str):
    """One key block of an online softmax: carry (max, sum, acc) of the blocks so far;
    scores [..., L] (masked: NEG_INF), values the block's. Every query has an unmasked key
    in block 0 (its own row's position 0), so the running max is finite from then on."""
    m, l, acc = carry
    m_new = jnp.maximum(m, scores.max(-1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    acc = acc * corr[..., None] + jnp.einsum(contract, p, values)
    return m_new, l * corr + p.sum(-1), acc


def _key_blocks(meta: PagedMetadata, block_pages: int):
    """The page table padded to whole key blocks, and the block count of the table."""
    r, p = meta.page_table.shape
    n = -(-p // block_pages)
    return jnp.pad(meta.page_table, ((0, 0), (0, n * block_pages - p))), n


def _blocks_needed(positions, valid, block_len: int, n: int):
    """Key blocks up to the longest context of these tokens (the loop's trip count: a
    wide page table costs nothing beyond it); at least one."""
    longest = jnp.max(jnp.where(valid, positions + 1, 1))
    return jnp.clip(-(-longest // block_len), 1, n)


# pages a decode iteration gathers for all its tokens together (k and v, 12 KB each for
# SmolLM2): a block is at most this many pages over the step's tokens, so a batch of
# decodes gathers about what its contexts need (8 tokens at context 100: 4 pages each,
# 377 us a layer where 16 pages each took 859 us) and its buffers stay small
PER_TOKEN_GATHER_PAGES = 32


def _blocked_attention(q, k_pages, v_pages, meta: PagedMetadata, k_scale=None,
                       v_scale=None, per_token: bool = True, block_pages: int = 16,
                       block_q: int = 256, open_prefix: bool = True):
    """Flash-style attention over the paged cache in blocks of block_pages pages, looping
    only over the blocks the longest context reaches. per_token: each token reads its own
    row's keys (a decode batch: one token per row), in blocks of at most
    PER_TOKEN_GATHER_PAGES / T pages. Otherwise the tokens go in query blocks of block_q;
    each block's keys are read once per row and every query of a query block is scored
    against all rows, masked to its own (prefill chunks: a 256-token chunk read per token
    re-read its context 256 times), up to the query block's own longest context (causal:
    the first query block of a long chunk skips the keys only later blocks see).
    open_prefix: with one row, the key blocks wholly before a query block skip the mask
    (False: every block masked, the A/B in bench/scripts/cpu_prefill_attention_probe.py)."""
    t, h, d = q.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    qg = q.reshape(t, kvh, g, d).astype(jnp.float32) * (d ** -0.5)
    if k_scale is not None:
        qg = qg * k_scale[None, :, None, None]
    valid = meta.slot_mapping >= 0

    def init(shape):
        return (jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape + (d,), jnp.float32))

    if per_token:
        bp = max(1, min(block_pages, PER_TOKEN_GATHER_PAGES // t))
        bl = bp * ps
        table, n = _key_blocks(meta, bp)
        table = table[meta.seq_ids]                                  # [T, n * bp]

        def block(i, carry):
            pages = jax.lax.dynamic_slice_in_dim(table, i * bp, bp, axis=1)
            kb, vb = (x[pages].astype(jnp.float32) for x in (k_pages, v_pages))  # [T,bp,KVH,ps,D]
            kb, vb = (x.transpose(0, 2, 1, 3, 4).reshape(t, kvh, bl, d) for x in (kb, vb))
            s = jnp.einsum("tkgd,tkld->tkgl", qg, kb)
            pos = i * bl + jnp.arange(bl, dtype=jnp.int32)
            mask = pos[None, :] <= meta.positions[:, None]          # [T, L]
            s = jnp.where(mask[:, None, None, :], s, NEG_INF)
            return _online_step(carry, s, vb, "tkgl,tkld->tkgd")

        n_blocks = _blocks_needed(meta.positions, valid, bl, n)
        _, l, acc = jax.lax.fori_loop(0, n_blocks, block, init(qg.shape[:-1]))
        out = acc / l[..., None]
        if v_scale is not None:
            out = out * v_scale[None, :, None, None]
        return out.reshape(t, h, d).astype(q.dtype)

    bl = block_pages * ps
    table, n = _key_blocks(meta, block_pages)
    r = table.shape[0]
    key_row = jnp.repeat(jnp.arange(r, dtype=jnp.int32), bl)
    bq = min(block_q, t)
    nq = -(-t // bq)
    pad = nq * bq - t  # padding queries: no slot, position 0 (attend key 0 of row 0)
    qb = jnp.pad(qg, ((0, pad), (0, 0), (0, 0), (0, 0)))
    qb = qb.reshape(nq, bq, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(nq, kvh, bq * g, d)
    pos_b, ids_b, valid_b = (jnp.pad(x, (0, pad)).reshape(nq, bq)
                             for x in (meta.positions, meta.seq_ids, valid))

    def query_block(xs):
        qj, pos_j, ids_j, valid_j = xs

        def block(i, carry, masked=True):
            pages = jax.lax.dynamic_slice_in_dim(table, i * block_pages, block_pages, axis=1)
            kb, vb = (x[pages].astype(jnp.float32) for x in (k_pages, v_pages))  # [R,bp,KVH,ps,D]
            kb, vb = (x.transpose(2, 0, 1, 3, 4).reshape(kvh, r * bl, d) for x in (kb, vb))
            s = jnp.einsum("ktd,kld->ktl", qj, kb)
            if masked:
                pos = i * bl + jnp.arange(bl, dtype=jnp.int32)
                mask = ((key_row[None, :] == ids_j[:, None])
                        & (jnp.tile(pos, r)[None, :] <= pos_j[:, None]))  # [bq, R*L]
                s = jnp.where(mask[None, :, None, :], s.reshape(kvh, bq, g, r * bl),
                              NEG_INF).reshape(kvh, bq * g, r * bl)
            return _online_step(carry, s, vb, "ktl,kld->ktd")

        n_blocks = _blocks_needed(pos_j, valid_j, bl, n)
        n_open = 0
        if r == 1 and open_prefix:
            # one sequence (a lone prompt's prefill): the key blocks before the query
            # block's first position are seen whole by all of it, so they skip the mask
            # (1-7% of this attention on the 2-core CPU, bench/results §50); padding
            # queries' outputs are discarded
            first = jnp.min(jnp.where(valid_j, pos_j, n * bl))
            n_open = jnp.clip((first + 1) // bl, 0, n_blocks)
        carry = jax.lax.fori_loop(0, n_open, functools.partial(block, masked=False),
                                  init(qj.shape[:-1]))
        _, l, acc = jax.lax.fori_loop(n_open, n_blocks, block, carry)
        return acc / l[..., None]                                  # [KVH, bq*G, D]

    out = jax.lax.map(query_block, (qb, pos_b, ids_b, valid_b))   # [nq, KVH, bq*G, D]
    if v_scale is not None:
        out = out * v_scale[None, :, None, None]
    out = out.reshape(nq, kvh, bq, g, d).transpose(0, 2, 1, 3, 4).reshape(nq * bq, h, d)
    return out[:t].astype(q.dtype)


def attend_cpu(q, kv_layer, meta: PagedMetadata, inv_freq, open_prefix: bool = True):
    """Pure-JAX attention for the CPU step (_blocked_attention): a decode-only batch reads
    each token's own context; a batch with prefill tokens reads each row's context once
    for all its tokens. Both branches compile; one runs. A one-token step is read per
    token without the branch (its token is its row's only one). open_prefix: see
    _blocked_attention (an A/B switch; the engine keeps the default)."""
    q = apply_rope(q, meta.positions, inv_freq)
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    if q.shape[0] == 1:
        return _blocked_attention(q, k_pages, v_pages, meta, ks, vs, per_token=True)
    decode_only = jnp.sum(meta.slot_mapping >= 0) <= meta.num_decodes
    return jax.lax.cond(
        decode_only,
        lambda: _blocked_attention(q, k_pages, v_pages, meta, ks, vs, per_token=True),
        lambda: _blocked_attention(q, k_pages, v_pages, meta, ks, vs, per_token=False,
                                   open_prefix=open_prefix))


def _decode_kernel(name: str):
    """The paged decode kernel: Triton (pallas_kernels/decode_attention.py, any GPU), the
    Mosaic GPU swap-AB kernel (decode_attention_swapab.py, Hopper: keeps its bandwidth on
    a bounded grid) or the earlier Mosaic GPU row-tile kernel (decode_attention_mgpu.py)."""
    if name == "mosaic":
        from pallas_kernels.decode_attention_swapab import decode_attention_swapab
        return decode_attention_swapab
    if name == "mosaic-rows":
        from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu
        return decode_attention_mgpu
    if name == "triton":
        from pallas_kernels.decode_attention import decode_attention_impl
        return decode_attention_impl
    raise ValueError(f"no decode kernel {name!r}")


def choose_decode_kernel(name: str, q, k_pages) -> str:
    """"auto": the Mosaic GPU swap-AB kernel on a Hopper or newer GPU when it takes the
    operands (16-bit, head dim % 64, page size % 8, group <= its column limit; on the H200
    it reads 98-102% of copy bandwidth on the full grid, 94% on half the SMs, where Triton
    reads 61% and 34%), else Triton. Interpret mode (no GPU) gets Triton. FP8 pages go
    the same way ("mosaic-rows" reads none: Triton): at B 512 ctx 1024 on the full grid
    the swap-AB kernel read FP8 pages in 0.85x its bf16 time, Triton's FP8 path in 0.97x
    of it, and the 8B step with FP8 pages ran 1.036x faster through swap-AB than through
    Triton at 512/512 (bench/results §60)."""
    from pallas_kernels.decode_attention_swapab import unsupported
    if is_fp8(k_pages.dtype) and (name == "mosaic-rows"
                                  or name == "mosaic" and unsupported(q, k_pages)):
        return "triton"
    if name != "auto":
        return name
    from pallas_kernels.mosaic_gpu_support import on_hopper
    return "mosaic" if on_hopper() and unsupported(q, k_pages) is None else "triton"


def decode_programs(kernel: str, share: float | None, num_sms: int, ctas_per_sm: int = 4):
    """A resource share as the decode kernel's persistent grid (None: its full grid).
    Triton: share x SMs x programs per SM; the Mosaic GPU kernels run one program per SM,
    so a share is whole SMs and leaves the others free."""
    if share is None or share >= 1.0:
        return None
    per_sm = 1 if kernel.startswith("mosaic") else ctas_per_sm
    return max(1, round(share * num_sms * per_sm))


def decode_rows(meta: PagedMetadata):
    """The decode kernel's context length per row and its live row count: with query
    blocks the decodes (the other rows 0, the count num_decodes), without them every
    token at its own position (count None: all)."""
    if meta.prefill_blocks is None:
        return meta.positions + 1, None
    is_decode = jnp.arange(meta.positions.shape[0]) < meta.num_decodes
    return jnp.where(is_decode, meta.positions + 1, 0), meta.num_decodes


def prepare_pallas(meta: PagedMetadata, decode_kernel: str = "auto",
                   decode_longest_first: bool = True) -> PagedMetadata:
    """The Pallas backend's prepare: the swap-AB kernel's longest-first order, sorted once
    per step where that kernel may run (under "auto" also where it then does not: one
    unused sort of ~10 us). Sorted in each layer's stream region instead, it was 32 sorts,
    ~0.5 ms of the 8B step (bench/results §66). The order serves either page type."""
    if decode_kernel not in ("auto", "mosaic") or not decode_longest_first:
        return meta
    from pallas_kernels.decode_attention_swapab import longest_first
    return dataclasses.replace(meta, decode_order=longest_first(*decode_rows(meta)))


def attend_pallas(q, kv_layer, meta: PagedMetadata, inv_freq, share: float | None = None,
                  num_sms: int = 132, ctas_per_sm: int = 4, block_q: int = 16,
                  decode_kernel: str = "auto", decode_prefetch: bool | None = None,
                  decode_longest_first: bool = True, interpret: bool = False,
                  decode_fn: Callable | None = None):
    """GPU path: the Pallas paged kernels. share: the decode kernel's resource share.
    decode_fn: called in place of the chosen decode kernel, with its arguments (the
    pipeline's fused GEMM + attention launch, nanojax/pipeline/fused.py).

    Without query blocks every token is a row of the decode kernel with its own sequence's
    pages and a context that ends at its own position (causal for prefill chunks too, but
    each prefill token re-reads its whole context). With them (meta.prefill_blocks, made
    with the same block_q), the decode kernel serves the decode tokens and the
    chunked-prefill kernel the rest."""
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    kernel = choose_decode_kernel(decode_kernel, q, k_pages)
    decode = _decode_kernel(kernel)
    if kernel == "triton":
        decode = functools.partial(decode, prefetch=decode_prefetch)
    if kernel == "mosaic" and decode_longest_first:
        decode = functools.partial(decode, longest_first_order=True, order=meta.decode_order)
    if ks is not None:  # FP8 pages (Triton or swap-AB, see choose_decode_kernel)
        decode = functools.partial(decode, k_scale=ks, v_scale=vs)
    if decode_fn is not None:
        decode = decode_fn
    num_programs = decode_programs(kernel, share, num_sms, ctas_per_sm)
    q = apply_rope(q, meta.positions, inv_freq)
    rows = meta.page_table[meta.seq_ids]
    lens, num_rows = decode_rows(meta)
    if meta.prefill_blocks is None:
        return decode(q, k_pages, v_pages, rows, lens, num_programs=num_programs,
                      interpret=interpret)
    from pallas_kernels.prefill_attention import prefill_attention_impl
    is_decode = jnp.arange(q.shape[0]) < meta.num_decodes
    if kernel == "mosaic" and decode_fn is None:  # the decodes come first: the swap-AB
        # kernel skips the other rows' (sequence, kv head) items (their outputs unwritten,
        # the where below drops them) instead of loading and storing them with no keys
        decode = functools.partial(decode, num_rows=num_rows)
    dec = decode(q, k_pages, v_pages, rows, lens, num_programs=num_programs,
                 interpret=interpret)
    pre = prefill_attention_impl(q, k_pages, v_pages, meta.page_table, meta.positions,
                                 meta.prefill_blocks, meta.prefill_slot, block_q=block_q,
                                 k_scale=ks, v_scale=vs, interpret=interpret)
    return jnp.where(is_decode[:, None, None], dec, pre)


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """An AttentionBackend from an append and an attend function. takes_share: attend
    accepts share/num_sms/ctas_per_sm (the Pallas decode kernel's bounded grid)."""

    attend: Callable
    prefill_block_q: int | None = None
    append: Callable = append_kv
    takes_share: bool = False
    prepare: Callable = lambda meta: meta  # noqa: E731 (nothing to share)
    prefill_max_seqs: int = KernelConfig().prefill_max_seqs
    # attend's cost follows the batch's longest context, not the page table's width (it
    # loops over key blocks): the runner can then launch one width and compile less
    width_free: bool = False

    def attend_at(self, share: float, num_sms: int = 132, ctas_per_sm: int = 4) -> Callable:
        if self.takes_share and share < 1.0:
            return functools.partial(self.attend, share=share, num_sms=num_sms,
                                     ctas_per_sm=ctas_per_sm)
        return self.attend

    def __call__(self, q, k, v, kv_layer, meta: PagedMetadata, inv_freq):
        kv_layer = self.append(k, v, kv_layer, meta, inv_freq)
        return self.attend(q, kv_layer, meta, inv_freq), kv_layer


paged_attention = PagedAttention(attend_cpu, width_free=True)  # the pure-JAX backend (CPU)


def pallas_backend(kernels: KernelConfig = KernelConfig()) -> PagedAttention:
    """The Pallas backend the KernelConfig describes: the decode kernel it names; with
    prefill_kernel, prefill tokens go to the chunked-prefill kernel in query blocks of
    prefill_block_q tokens (the runner builds them); fused_append writes the cache with
    the fused RoPE + append kernel."""
    block_q = kernels.prefill_block_q if kernels.prefill_kernel else None
    attend = functools.partial(attend_pallas, block_q=kernels.prefill_block_q,
                               decode_kernel=kernels.decode_kernel,
                               decode_prefetch=kernels.decode_prefetch,
                               decode_longest_first=kernels.decode_longest_first,
                               interpret=kernels.interpret)
    append = (functools.partial(append_kv_pallas, interpret=kernels.interpret)
              if kernels.fused_append else append_kv)
    prepare = functools.partial(prepare_pallas, decode_kernel=kernels.decode_kernel,
                                decode_longest_first=kernels.decode_longest_first)
    return PagedAttention(attend, block_q, append, takes_share=True,
                          prefill_max_seqs=kernels.prefill_max_seqs, prepare=prepare)
