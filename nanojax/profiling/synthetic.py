"""Synthetic steady-state dense batches, for timing the step without a scheduler.

The batch is what the engine's dense batch looks like once a workload is in steady state:
decodes first, with contexts spread over [prompt, prompt + output), then prefill chunks
filling the rest up to B_dense. For a workload of prompt I and output O per request, a
request spends I tokens in prefill and O in decode, so O / (I + O) of the batch are decodes.
Sequences draw their pages from a shared pool (pages may repeat across sequences): reads
cost the same bandwidth as distinct pages once the pool is far larger than L2, and the cache
fits on one GPU at any batch.
Per-sequence arrays (page table, context lengths, the LM head's rows) have the engine's
row count, padding rows as the runner pads them (zeros: no pages, the logits of token 0).
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
    logit_idx: np.ndarray  # [rows]: each sequence's last token, then padding (token 0)
    num_decodes: int
    num_prefill_tokens: int
    kv_tokens_read: int  # keys attended over, summed over tokens: the attention's traffic
    num_seqs: int  # sequences (decodes, then prefill chunks): rows [0, num_seqs) sample

    @property
    def rows(self) -> int:
        return len(self.logit_idx)


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


def steady_state_seqs(lengths: list[tuple[int, int]], b_dense: int,
                      cuts: tuple[int, ...] = (), seed: int = 0) -> int:
    """How many sequences synthetic_batch's batch of the same arguments holds."""
    contexts, chunks = steady_state_mix(lengths, b_dense, np.random.default_rng(seed), cuts)
    return len(contexts) + len(chunks)


def engine_batch_rows(lengths: dict, b_dense: int, cuts: tuple[int, ...] = (),
                      max_num_seqs: int | None = None, on_gpu: bool | None = None) -> int:
    """The engine's row count for the steady-state batches of these workloads
    ({workload: lengths}) at B_dense: an engine allowed max_num_seqs sequences (capped at
    B_dense, as the scheduler caps it; None: the most any batch holds), padded as the
    runner pads (engine_rows, with the engine's default smallest row bucket).
    NanojaxError when max_num_seqs is too few for a batch."""
    import jax

    from nanojax.config import EngineConfig, Platform
    from nanojax.engine.runner import engine_rows
    seqs = {w: steady_state_seqs(ls, b_dense, cuts) for w, ls in lengths.items()}
    most = max(seqs.values())
    if max_num_seqs is not None and max_num_seqs < most:
        w = max(seqs, key=seqs.get)
        raise NanojaxError(f"--max-num-seqs {max_num_seqs} is below the {most} sequences of "
                           f"workload {w}'s steady-state batch at B_dense {b_dense}")
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    # the GPU engine runs one row shape (fixed shapes); the CPU's varies
    rows = EngineConfig().resolve(Platform(on_gpu, 1, 1)).min_row_bucket  # the default's
    return engine_rows(min(max_num_seqs or most, b_dense), rows, one_shape=on_gpu)


def synthetic_batch(cfg: ModelConfig, b_dense: int, lengths: list[tuple[int, int]],
                    page_size: int, num_pages: int, max_pages: int,
                    cuts: tuple[int, ...] = (), seed: int = 0,
                    prefill_block_q: int | None = None,
                    prefill_max_seqs: int | None = None,
                    rows: int | None = None) -> SyntheticBatch:
    """A steady-state dense batch of the workload `lengths` (see steady_state_mix).
    prefill_block_q, prefill_max_seqs: the chunked-prefill kernel's query blocks, bounded
    as the engine bounds them (None: one block per row at most). rows: see build_batch."""
    rng = np.random.default_rng(seed)
    contexts, chunks = steady_state_mix(lengths, b_dense, rng, cuts)
    return build_batch(cfg, contexts, chunks, page_size, num_pages, max_pages, rng,
                       prefill_block_q, prefill_max_seqs, rows)


def build_batch(cfg: ModelConfig, contexts: list[int], chunks: list[int], page_size: int,
                num_pages: int, max_pages: int, rng: np.random.Generator,
                prefill_block_q: int | None = None, prefill_max_seqs: int | None = None,
                rows: int | None = None) -> SyntheticBatch:
    """Decodes with these contexts, then prefill chunks (from position 0) of these lengths.
    Pages that this step writes are each sequence's own; the pages it only reads come
    from a shared pool, so every mode reads the same cache contents. rows: the row count
    the engine pads the batch to (runner.engine_rows); None: one row per sequence."""
    contexts = [min(c, max_pages * page_size) for c in contexts]
    chunks = [min(n, max_pages * page_size) for n in chunks]
    t = len(contexts) + sum(chunks)
    seqs = len(contexts) + len(chunks)
    rows = seqs if rows is None else rows
    if rows < seqs:
        raise ValueError(f"{rows} rows cannot hold the batch's {seqs} sequences")
    written = len(contexts) + sum(-(-n // page_size) for n in chunks)
    if written * 2 > num_pages:
        raise ValueError(f"a KV pool of {num_pages} pages is too small for {t} tokens")
    shared = num_pages - written
    fresh = iter(range(shared, num_pages))
    positions = np.zeros(t, np.int32)
    seq_ids = np.zeros(t, np.int32)
    page_table = np.zeros((rows, max_pages), np.int32)
    page_table[:seqs] = rng.integers(0, shared, (seqs, max_pages))
    context_lens = np.zeros(rows, np.int32)
    logit_idx = np.zeros(rows, np.int32)
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
                                        prefill_block_q, min(rows, prefill_max_seqs or rows))
    meta = PagedMetadata(positions=positions, slot_mapping=slots.astype(np.int32),
                         seq_ids=seq_ids, page_table=page_table, context_lens=context_lens,
                         num_decodes=np.int32(len(contexts)), prefill_blocks=blocks,
                         prefill_slot=slot)
    tokens = rng.integers(min(1000, cfg.vocab_size // 2), cfg.vocab_size, t)
    return SyntheticBatch(tokens.astype(np.int32), meta, logit_idx, len(contexts),
                          t - len(contexts), int((positions + 1).sum()), seqs)


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
