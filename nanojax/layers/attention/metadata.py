"""What a step tells its attention about the batch: the metadata pytrees (contiguous and
paged cache), the chunked-prefill kernel's query blocks, and a nano-batch's slice."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ContiguousMetadata:
    """One sequence over a contiguous cache (the plain reference path, no paging)."""

    positions: jax.Array  # [T] absolute positions of the tokens (also their cache slots)


# Paged cache: pages are [num_pages, KVH, page_size, D] (head-major within a page).
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


def packed_prefills(sequences: list[list[int]], score_from: list[int], group: int, ps: int):
    """Whole sequences as prefills, `group` of them packed into each batch (own pages each,
    padded to one shape, so one compile): yields (tokens, metadata, rows whose logits
    predict tokens score_from[i].., pages). For scoring and calibration passes."""
    width = -(-max(map(len, sequences)) // ps)
    t_max = group * max(map(len, sequences))
    for g0 in range(0, len(sequences), group):
        tokens = np.zeros(t_max, np.int32)
        positions = np.zeros(t_max, np.int32)
        slots = np.full(t_max, -1, np.int32)
        seq_ids = np.zeros(t_max, np.int32)
        page_table = np.zeros((group, width), np.int32)
        lens = np.zeros(group, np.int32)
        rows: list[int] = []
        i = 0
        for r, (s, start) in enumerate(zip(sequences[g0:g0 + group],
                                           score_from[g0:g0 + group])):
            n = len(s)
            page_table[r] = r * width + np.arange(width)
            tokens[i:i + n], positions[i:i + n], seq_ids[i:i + n] = s, np.arange(n), r
            slots[i:i + n] = page_table[r, np.arange(n) // ps] * ps + np.arange(n) % ps
            lens[r] = n
            rows += range(i + start - 1, i + n - 1)
            i += n
        meta = PagedMetadata(positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots),
                             seq_ids=jnp.asarray(seq_ids), page_table=jnp.asarray(page_table),
                             context_lens=jnp.asarray(lens), num_decodes=jnp.int32(0))
        yield tokens, meta, np.asarray(rows, np.int32), group * width
