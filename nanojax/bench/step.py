"""One dense iteration, timed on the device: the decoder step of each pipeline mode on a
synthetic steady-state batch, without the scheduler around it.

The batch is what the engine's dense batch looks like once a workload is in steady state:
decodes first, with contexts spread over [prompt, prompt + output), then prefill chunks
filling the rest up to B_dense. For a workload of prompt I and output O per request, a
request spends I tokens in prefill and O in decode, so O / (I + O) of the batch are decodes.
Sequences draw their pages from a shared pool (pages may repeat across sequences): reads
cost the same bandwidth as distinct pages once the pool is far larger than L2, and the cache
fits on one GPU at any batch.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import ModelConfig
from nanojax.layers.attention import PagedMetadata, prefill_metadata


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
                    prefill_block_q: int | None = None) -> SyntheticBatch:
    """A steady-state dense batch of the workload `lengths` (see steady_state_mix)."""
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
                                        prefill_block_q, t)
    meta = PagedMetadata(positions=positions, slot_mapping=slots.astype(np.int32),
                         seq_ids=seq_ids, page_table=page_table, context_lens=context_lens,
                         num_decodes=np.int32(len(contexts)), prefill_blocks=blocks,
                         prefill_slot=slot)
    tokens = rng.integers(min(1000, cfg.vocab_size // 2), cfg.vocab_size, t)
    return SyntheticBatch(tokens.astype(np.int32), meta, logit_idx, len(contexts),
                          t - len(contexts), int((positions + 1).sum()))


_CHECK_ROWS = 64  # rows whose logits come back to compare the modes numerically


def make_step(forward):
    """The jitted iteration: forward over the dense batch, greedy sample per row; returns
    the sampled tokens and the logits of _CHECK_ROWS rows spread over the batch (so every
    nano-batch has rows among them)."""
    def step(params, kv, tokens, meta, logit_idx):
        logits, kv = forward(params, tokens, kv, meta, logit_idx)
        rows = np.linspace(0, logits.shape[0] - 1, min(_CHECK_ROWS, logits.shape[0]))
        return kv, (jnp.argmax(logits, axis=-1), logits[rows.astype(np.int32)])
    return jax.jit(step, donate_argnums=(1,))


def time_step(step, params, kv, batch: SyntheticBatch, repeats: int = 10):
    """Median seconds of one step (each call is one executable, tens of ms: dispatch, ~0.1
    ms, is noise here); returns (seconds, kv, sampled tokens and logits of the last call,
    those of the first). Every call sees the same cache contents (it rewrites the same
    slots with the same values), so a deterministic step returns the same output each time."""
    args = (batch.tokens, batch.meta, batch.logit_idx)
    kv, out = step(params, kv, *args)  # compile + warm up
    first = jax.device_get(out)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        kv, out = step(params, kv, *args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), kv, jax.device_get(out), first


def workload_lengths(spec: str, max_model_len: int) -> list[tuple[int, int]]:
    """'512/512' (prompt/output) or a trace name or CSV path."""
    from nanojax.bench.workload import trace_lengths
    from nanojax.errors import NanojaxError
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


def parse_mode(mode: str) -> dict:
    """A step benchmark mode, BASE[:SHARE][:nogroups][:keepinputs|keepall][:gemmSHARE]:
    'overlap:0.25' runs the plan with every attention nano-op at share 0.25; 'nogroups'
    turns off the executor's XLA scheduling groups (the ablation that shows what they do);
    'gemm0.5' gives every GEMM nano-op share 0.5 and bounds its grid (layers/matmul.py,
    whatever NANOJAX_GEMM_SHARES says); 'keepinputs' makes side-stream regions return
    their inputs, 'keepall' every value computed inside them (PipelineForward's
    diagnostics). ValueError names a bad mode."""
    from nanojax.pipeline.plan import MODES
    base, *opts = mode.split(":")
    out = {"base": base, "attention_share": None, "gemm_share": None,
           "scheduling_groups": True, "keep": ""}
    try:
        if opts and opts[0]:
            out["attention_share"] = float(opts[0])
        for o in opts[1:]:
            if o == "nogroups":
                out["scheduling_groups"] = False
            elif o in ("keepinputs", "keepall") and not out["keep"]:
                out["keep"] = "inputs" if o == "keepinputs" else "values"
            elif o.startswith("gemm"):
                out["gemm_share"] = float(o[4:])
            else:
                raise ValueError
    except ValueError:
        raise ValueError(mode) from None
    if base not in MODES or any(s is not None and not 0 < s <= 1
                                for s in (out["attention_share"], out["gemm_share"])):
        raise ValueError(mode)
    return out


def _variant(plan: dict, mode: str):
    """The plan and PipelineForward arguments of a mode (parse_mode)."""
    m = parse_mode(mode)
    plan = copy.deepcopy(plan)
    for op in plan["nano_ops"]:
        share = m["attention_share"] if op["op"] == "attention" else m["gemm_share"]
        if share is not None:
            op["share"] = share
    return plan, m["base"], dict(scheduling_groups=m["scheduling_groups"],
                                 keep=m["keep"],
                                 gemm_shares=True if m["gemm_share"] is not None else None)


def f32_reference_outputs(bundle, plan: dict, batches: dict, num_pages: int,
                          page_size: int) -> dict:
    """workload -> (tokens, checked rows' logits) of the non-overlap step with weights,
    activations, KV cache and matmuls in float32 (highest precision: no TF32)."""
    from nanojax.pipeline.executor import PipelineForward
    fwd = PipelineForward(bundle.config.replace(dtype="float32"), plan, "non-overlap")
    params = fwd.prepare(jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        bundle.params))
    step = make_step(fwd)
    out = {}
    with jax.default_matmul_precision("highest"):
        for w, b in batches.items():
            _, o = step(params, fwd.init_kv(num_pages, page_size), b.tokens, b.meta,
                        b.logit_idx)
            out[w] = jax.device_get(o)
    return out


def logits_distance(logits, ref_logits) -> float:
    """max |logits - ref| in standard deviations of ref: how two steps' numerics differ."""
    diff = np.abs(np.asarray(logits, np.float32) - np.asarray(ref_logits, np.float32))
    return float(np.max(diff) / np.std(np.asarray(ref_logits, np.float32)))


def run_step_bench(bundle, plan: dict, b_dense_list: list[int], workloads: list[str],
                   modes: list[str], page_size: int = 16, num_pages: int = 16384,
                   max_model_len: int = 2048, repeats: int = 10, timeline_png: str | None = None,
                   progress: bool = True, checkpoint=None, f32_reference: bool = False,
                   kv_cache_dtype: str = "auto") -> dict:
    """Every mode at every B_dense and workload, in one process: ratios between modes come
    from the same run. Optimal = the GEMM rate measured here at that B_dense.
    checkpoint(results) is called after every mode, so a run cut short keeps what it has.
    f32_reference: also run the step in float32 and say how far each mode's logits are
    from it (what a mode's difference from another must be measured against on a GPU,
    where each GEMM shape may get another kernel and so another rounding).
    kv_cache_dtype: the cache's element type (--kv-cache-dtype; the float32 reference
    keeps a float32 cache)."""
    from tqdm.auto import tqdm

    from nanojax.bench import timeline
    from nanojax.bench.roofline import CARD_TFLOPS, measure_gemm_rate, optimal_tokens_per_s
    from nanojax.engine.forward import default_forward
    from nanojax.pipeline.executor import PipelineForward
    from nanojax.pipeline.plan import resize

    from nanojax.layers.kv_fp8 import resolve_kv_cache_dtype

    cfg = bundle.config
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, cfg.dtype)
    max_pages = -(-max_model_len // page_size)
    on_gpu = jax.default_backend() == "gpu"
    results, timelines = [], {}
    bar = tqdm(total=len(b_dense_list) * len(workloads) * len(modes), desc="steps",
               disable=not progress)
    params = kv = None
    for b_dense in b_dense_list:
        roof = measure_gemm_rate(cfg, b_dense) if on_gpu else None
        sized = resize(plan, b_dense)
        cuts = tuple(a for a, _ in sized["nano_batches"]["attention"][1:])
        block_q = default_forward(cfg).attention.prefill_block_q
        batches = {w: synthetic_batch(cfg, b_dense, workload_lengths(w, max_model_len),
                                      page_size, num_pages, max_pages, cuts,
                                      prefill_block_q=block_q)
                   for w in workloads}
        tokens = {}
        for mode in modes:
            p, base, options = _variant(sized, mode)
            fwd = PipelineForward(cfg, p, base, **options)
            if params is None:
                params = fwd.prepare(bundle.params)
                kv = fwd.init_kv(num_pages, page_size, kv_dtype)
            step = make_step(fwd)
            t0 = time.perf_counter()
            try:
                step.lower(params, kv, *(lambda b: (b.tokens, b.meta, b.logit_idx))(
                    batches[workloads[0]])).compile()
            except Exception as e:  # record the mode's failure, measure the others
                results.append({"b_dense": b_dense, "mode": mode,
                                "error": f"{type(e).__name__}: {str(e)[:1500]}"})
                bar.update(len(workloads))
                continue
            compile_s = time.perf_counter() - t0
            for w in workloads:
                b = batches[w]
                kv = None  # a fresh cache: every mode starts from the same contents
                kv = fwd.init_kv(num_pages, page_size, kv_dtype)
                secs, kv, out, first = time_step(step, params, kv, b, repeats)
                tokens.setdefault(w, {})[mode] = out
                r = {"b_dense": b_dense, "workload": w, "mode": mode, "step_s": secs,
                     "tokens_per_s": b_dense / secs, "compile_s": compile_s,
                     # the same step twice on the same inputs: a race shows up here
                     "repeat_same_tokens": float(np.mean(first[0] == out[0])),
                     "repeat_logits_max_abs_diff": float(np.max(np.abs(
                         np.asarray(first[1], np.float32) - np.asarray(out[1], np.float32)))),
                     "num_decodes": b.num_decodes, "num_prefill_tokens": b.num_prefill_tokens,
                     "kv_tokens_read_per_layer": b.kv_tokens_read}
                if roof:
                    r["fraction_of_optimal"] = r["tokens_per_s"] / roof["optimal_tokens_per_s"]
                    r["fraction_of_optimal_at_790_tflops"] = r["tokens_per_s"] / (
                        optimal_tokens_per_s(cfg, CARD_TFLOPS * 1e12))
                    r["optimal_tokens_per_s"] = roof["optimal_tokens_per_s"]
                    r["gemm_tflops"] = roof["gemm_flops_per_s"] / 1e12
                # do the modes compute the same function on the same batch? (against the
                # first mode, row by row, so a run cut short keeps the comparison)
                ref_mode = next(iter(tokens[w]))
                ref_tok, ref_logits = tokens[w][ref_mode]
                r["same_tokens_as_" + ref_mode] = float(np.mean(out[0] == ref_tok))
                # which sequences differ (decodes come first): where to look next
                r["differing_sequences"] = np.flatnonzero(out[0] != ref_tok)[:32].tolist()
                r["logits_max_diff_over_std"] = logits_distance(out[1], ref_logits)
                if timeline_png and b_dense == b_dense_list[0] and w == workloads[0]:
                    args = (b.tokens, b.meta, b.logit_idx)
                    holder = {}

                    def once(step=step, kv=kv):
                        holder["kv"], o = step(params, kv, *args)
                        jax.block_until_ready(o)
                    ev = timeline.capture(once)
                    kv = holder["kv"]
                    timelines[mode] = ev
                    r["timeline"] = timeline.summarize(ev)
                results.append(r)
                bar.update(1)
            del step, fwd
            if checkpoint:
                checkpoint({"partial": True, "results": results})
        if f32_reference:
            ref = f32_reference_outputs(bundle, sized, batches, num_pages, page_size)
            for r in results:
                if r["b_dense"] == b_dense and "error" not in r:
                    (tok, logits), (ref_tok, ref_logits) = (tokens[r["workload"]][r["mode"]],
                                                            ref[r["workload"]])
                    r["same_tokens_as_f32"] = float(np.mean(tok == ref_tok))
                    r["logits_max_diff_over_std_vs_f32"] = logits_distance(logits, ref_logits)
    bar.close()
    ratios = []
    for b_dense in b_dense_list:
        for w in workloads:
            t = {r["mode"]: r["tokens_per_s"] for r in results
                 if r["b_dense"] == b_dense and r.get("workload") == w}
            row = {"b_dense": b_dense, "workload": w}
            if "overlap" in t and "non-overlap" in t:
                row["overlap_over_non_overlap"] = t["overlap"] / t["non-overlap"]
            if "overlap" in t and "nanobatch-only" in t:
                row["overlap_over_nanobatch_only"] = t["overlap"] / t["nanobatch-only"]
            ratios.append(row)
    if timeline_png and timelines:
        events_path = str(Path(timeline_png).with_suffix(".events.json"))
        Path(events_path).write_text(json.dumps(timelines))
        try:
            timeline.plot(timelines, timeline_png,
                          f"one iteration, B_dense {b_dense_list[0]}, workload {workloads[0]}")
        except ImportError:  # matplotlib absent: the events file can be plotted elsewhere
            pass
    return {"results": results, "ratios": ratios}
