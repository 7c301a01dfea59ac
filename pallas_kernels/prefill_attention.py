"""Chunked-prefill attention over the paged cache: a Pallas kernel and its reference.

A prefill chunk's tokens attend causally within the chunk and fully to the cached prefix of
their request. Run as decode rows (one row per token, as the engine did first), every token
re-reads its whole context: a 512-token chunk reads its keys ~256 times. Here the chunk is
cut into query blocks of `block_q` consecutive tokens; a unit of work is one (query block,
kv head), whose block_q x group query rows share one pass over the keys (flash-style online
softmax, the decode kernel's loop), each row masked at its own position. The keys are read
once per block instead of once per token.

The query blocks are made on the host (`query_blocks`) from the batch's sequence ids and
positions, as the engine's runner builds the rest of the step's metadata.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.decode_attention import (decode_attention_reference,
                                             paged_attention_call, padded_rows)


def prefill_attention_reference(q, k_pages, v_pages, page_table, seq_ids, positions,
                                k_scale=None, v_scale=None):
    """q [T, H, D]: token t attends to its sequence's keys at positions <= positions[t].
    k_scale, v_scale [KVH]: FP8 pages' scales (see decode_attention.py), or None."""
    return decode_attention_reference(q, k_pages, v_pages, page_table[seq_ids],
                                      positions + 1, k_scale, v_scale)


def query_blocks(seq_ids: np.ndarray, positions: np.ndarray, block_q: int,
                 max_blocks: int | None = None):
    """Cuts the tokens into blocks of at most block_q consecutive tokens of one sequence.

    Returns blocks [NB, 3] int32 (first token, tokens, sequence row; unused blocks have 0
    tokens) and token_slot [T] int32 (block * block_q + offset of each token). NB is
    max_blocks, by default T // block_q + the number of runs (enough for any cutting).
    """
    seq_ids, positions = np.asarray(seq_ids), np.asarray(positions)
    t = len(seq_ids)
    breaks = (seq_ids[1:] != seq_ids[:-1]) | (positions[1:] != positions[:-1] + 1)
    starts = [0] + (np.flatnonzero(breaks) + 1).tolist() if t else []
    runs = list(zip(starts, starts[1:] + [t]))
    nb = max_blocks or (t // block_q + len(runs))
    blocks = np.zeros((nb, 3), np.int32)
    slot = np.zeros(t, np.int32)
    i = 0
    for a, b in runs:
        for c in range(a, b, block_q):
            n = min(block_q, b - c)
            if i >= nb:
                raise ValueError(f"{nb} query blocks are too few for this batch")
            blocks[i] = (c, n, seq_ids[c])
            slot[c:c + n] = i * block_q + np.arange(n)
            i += 1
    return blocks, slot


def in_place_unsupported(heads: int, kv_heads: int, block_q: int) -> str | None:
    """Why prefill_attention_impl cannot write into `out` for this shape (None: it can):
    a unit's rows, block_q tokens x the query group, are loaded as they lie, so they must
    be a power of 2 of at least 16 (Pallas' Triton lowering)."""
    rows = block_q * (heads // kv_heads)
    if rows != padded_rows(rows):
        return (f"query blocks of {block_q} tokens x {heads // kv_heads} heads are {rows} "
                f"rows, not a power of 2 of at least 16")
    return None


def prefill_attention_impl(q, k_pages, v_pages, page_table, positions, blocks, token_slot,
                           *, k_scale=None, v_scale=None, block_q: int = 16, num_programs: int | None = None,
                           pages_per_block: int | None = None, num_warps: int | None = None,
                           num_stages: int = 2, interpret: bool = False, out=None):
    """Same result as prefill_attention_reference, for tokens grouped by query_blocks.
    out [T, H, D] (where in_place_unsupported says it can): the prefill tokens' rows are
    written into it, the queries read where they are (no gather into blocks, no scatter
    back); its other rows (the decodes') come back as they were."""
    t, h, d = q.shape
    kvh = k_pages.shape[1]
    g = h // kvh
    nb = blocks.shape[0]
    offs = jnp.arange(block_q, dtype=jnp.int32)
    valid = offs[None, :] < blocks[:, 1:2]                          # [NB, bq]
    tok = jnp.where(valid, blocks[:, 0:1] + offs[None, :], 0)       # [NB, bq]
    kernel_args = dict(k_scale=k_scale, v_scale=v_scale, num_programs=num_programs,
                       pages_per_block=pages_per_block, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret)
    last = jnp.where(valid, positions[tok], -1)                      # [NB, bq]
    last = jnp.repeat(last, g, axis=1)                               # row = token * g + head
    if out is not None:
        if (why := in_place_unsupported(h, kvh, block_q)) is not None:
            raise ValueError(why)
        res = paged_attention_call(q.reshape(t, kvh, g, d), k_pages, v_pages,
                                   page_table[blocks[:, 2]], last.max(axis=1) + 1, last,
                                   token_blocks=blocks[:, :2],
                                   out=out.reshape(t, kvh, g, d), **kernel_args)
        return res.reshape(t, h, d)
    qb = q[tok].reshape(nb, block_q, kvh, g, d).transpose(0, 2, 1, 3, 4)
    qb = qb.reshape(nb, kvh, block_q * g, d)
    rows = padded_rows(block_q * g)
    if rows > block_q * g:
        pad = rows - block_q * g
        qb = lax.pad(qb, jnp.zeros((), qb.dtype), [(0, 0, 0), (0, 0, 0), (0, pad, 0),
                                                   (0, 0, 0)])
        last = lax.pad(last, jnp.int32(-1), [(0, 0, 0), (0, pad, 0)])
    ctx = last.max(axis=1) + 1                                       # 0 for unused blocks
    out = paged_attention_call(qb, k_pages, v_pages, page_table[blocks[:, 2]], ctx, last,
                               **kernel_args)
    out = out[:, :, :block_q * g].reshape(nb, kvh, block_q, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(nb * block_q, h, d)[token_slot]


prefill_attention = jax.jit(prefill_attention_impl, static_argnames=(
    "block_q", "num_programs", "pages_per_block", "num_warps", "num_stages", "interpret"))
