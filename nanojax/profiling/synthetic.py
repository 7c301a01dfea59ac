"""Synthetic steady-state dense batches, for timing the step without a scheduler.

The batch is what the engine's dense batch looks like once a workload is in steady state:
decodes first, with contexts spread over [prompt, prompt + output), then prefill chunks
filling the rest up to B_dense. For a workload of prompt I and output O per request, a
request spends I tokens in prefill and O in decode, so O / (I + O) of the batch are decodes.
Sequences draw their pages from a shared pool (pages may repeat across sequences): reads
cost the same bandwidth as distinct pages once the pool is far larger than L2, and the cache
fits on one GPU at any batch.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from nanojax.config import ModelConfig
from nanojax.errors import NanojaxError
from nanojax.layers.attention import PagedMetadata, prefill_metadata
from nanojax.traces import trace_lengths


@dataclasses.dataclass
class SyntheticBatch:
    tokens: np.ndarray
    meta: PagedMetadata
    logit_idx: np.ndarray
    num_decodes: int
    num_prefill_tokens: int
    kv_tokens_read: int  # keys attended over, summed over tokens: the attention's traffic


def steady_state_mix(lengths: list[tuple[int, int]], b_dense: int,
                     rng: np.random.Generator, cuts: tuple[int, ...] = ()):
    """Decode contexts and prefill chunk lengths of a steady-state dense batch of requests
    drawn from `lengths` [(prompt, output)]; chunks end at `cuts`, as the scheduler's do."""
    lengths = np.asarray(lengths)
    decode_share = lengths[:, 1].sum() / lengths.sum()
    num_decodes = int(round(b_dense * decode_share))
    picks = lengths[rng.integers(0, len(lengths), num_decodes)]
    contexts = picks[:, 0] + (rng.random(num_decodes) * picks[:, 1]).astype(int) + 1
    chunks, pos, left = [], num_decodes, 0
    bounds = sorted(c for c in cuts if c > num_decodes) + [b_dense]
    while pos < b_dense:
        if left == 0:
            left = max(int(lengths[rng.integers(0, len(lengths)), 0]), 1)
        n = min(left, next(c for c in bounds if c > pos) - pos)
        chunks.append(n)
        pos += n
        left -= n
    return contexts.tolist(), chunks


def synthetic_batch(cfg: ModelConfig, b_dense: int, lengths: list[tuple[int, int]],
                    page_size: int, num_pages: int, max_pages: int,
                    cuts: tuple[int, ...] = (), seed: int = 0,
                    prefill_block_q: int | None = None,
                    prefill_max_seqs: int | None = None) -> SyntheticBatch:
    """A steady-state dense batch of the workload `lengths` (see steady_state_mix).
    prefill_block_q, prefill_max_seqs: the chunked-prefill kernel's query blocks, bounded
    as the engine bounds them (None: one block per row at most)."""
    rng = np.random.default_rng(seed)
    contexts, chunks = steady_state_mix(lengths, b_dense, rng, cuts)
    return build_batch(cfg, contexts, chunks, page_size, num_pages, max_pages, rng,
                       prefill_block_q)


def build_batch(cfg: ModelConfig, contexts: list[int], chunks: list[int], page_size: int,
                num_pages: int, max_pages: int, rng: np.random.Generator,
                prefill_block_q: int | None = None) -> SyntheticBatch:
    """Decodes with these contexts, then prefill chunks (from position 0) of these lengths.
    Pages that this step writes are each sequence's own; the pages it only reads come
    from a shared pool, so every mode reads the same cache contents."""
    contexts = [min(c, max_pages * page_size) for c in contexts]
    chunks = [min(n, max_pages * page_size) for n in chunks]
    t = len(contexts) + sum(chunks)
    written = len(contexts) + sum(-(-n // page_size) for n in chunks)
    if written * 2 > num_pages:
        raise ValueError(f"a KV pool of {num_pages} pages is too small for {t} tokens")
    shared = num_pages - written
    fresh = iter(range(shared, num_pages))
    positions = np.zeros(t, np.int32)
    seq_ids = np.zeros(t, np.int32)
    page_table = rng.integers(0, shared, (t, max_pages)).astype(np.int32)
    context_lens = np.zeros(t, np.int32)
    logit_idx = np.zeros(t, np.int32)
    i = 0
    for row, c in enumerate(contexts):
        positions[i], seq_ids[i], context_lens[row], logit_idx[row] = c - 1, row, c, i
        page_table[row, (c - 1) // page_size] = next(fresh)
        i += 1
    for j, n in enumerate(chunks):
        row = len(contexts) + j
        positions[i:i + n] = np.arange(n)
        seq_ids[i:i + n] = row
        context_lens[row], logit_idx[row] = n, i + n - 1
        for p in range(-(-n // page_size)):
            page_table[row, p] = next(fresh)
        i += n
    slots = page_table[seq_ids, positions // page_size] * page_size + positions % page_size
    blocks = slot = None
    if prefill_block_q:  # query blocks for the chunked-prefill kernel, as the runner makes
        blocks, slot = prefill_metadata(seq_ids, positions, len(contexts), t,
                                        prefill_block_q, prefill_max_seqs or t)
    meta = PagedMetadata(positions=positions, slot_mapping=slots.astype(np.int32),
                         seq_ids=seq_ids, page_table=page_table, context_lens=context_lens,
                         num_decodes=np.int32(len(contexts)), prefill_blocks=blocks,
                         prefill_slot=slot)
    tokens = rng.integers(min(1000, cfg.vocab_size // 2), cfg.vocab_size, t)
    return SyntheticBatch(tokens.astype(np.int32), meta, logit_idx, len(contexts),
                          t - len(contexts), int((positions + 1).sum()))


def workload_lengths(spec: str, max_model_len: int) -> list[tuple[int, int]]:
    """'512/512' (prompt/output) or a trace name or CSV path."""
    if "/" in spec and not spec.endswith(".csv"):
        try:
            i, o = (int(x) for x in spec.split("/"))
        except ValueError:
            raise NanojaxError(f"workload {spec!r} is not PROMPT/OUTPUT or a trace") from None
        lengths = [(i, o)]
    else:
        lengths = trace_lengths(spec)
    lengths = [(i, o) for i, o in lengths if 0 < i and 0 < o and i + o <= max_model_len]
    if not lengths:
        raise NanojaxError(f"no request of workload {spec} fits max_model_len {max_model_len}")
    return lengths
