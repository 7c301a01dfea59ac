"""The CPU backend: flash-style (online softmax) attention over the paged cache in key
blocks, looping only as far as the batch's longest context, in pure JAX."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nanojax.layers.attention.backend import PagedAttention
from nanojax.layers.attention.metadata import PagedMetadata
from nanojax.layers.attention.reference import NEG_INF
from nanojax.layers.kv_fp8 import kv_parts
from nanojax.layers.rotary import apply_rope


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


# pages a decode iteration gathers for all its tokens together: a block is at most this
# many pages over the step's tokens, so a batch of decodes gathers about what its contexts
# need and its buffers stay small (measured: bench/results/log/cpu.md)
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
    (False: every block masked, the A/B in bench/repro/cpu/cpu_prefill_attention_probe.py)."""
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
        n_open: int | jax.Array = 0
        if r == 1 and open_prefix:
            # one sequence (a lone prompt's prefill): the key blocks before the query
            # block's first position are seen whole by all of it, so they skip the mask
            # (a small gain on the CPU: bench/results/log/cpu.md); padding queries'
            # outputs are discarded
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


paged_attention = PagedAttention(attend_cpu, width_free=True)  # the pure-JAX backend (CPU)
