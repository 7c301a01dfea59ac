"""One dense iteration, timed on the device: the decoder step of each pipeline mode on a
synthetic steady-state batch (nanojax/profiling/synthetic.py), without the scheduler
around it."""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import KernelConfig, ModelConfig
from nanojax.errors import ConfigError
from nanojax.profiling.synthetic import (SyntheticBatch, engine_batch_rows, synthetic_batch,
                                         workload_lengths)


_CHECK_ROWS = 64  # rows whose logits come back to compare the modes numerically
# a mode's LM head rows (parse_mode): the engine's row count (its padding rows' logits
# included), all B_dense tokens (the step bench before it padded as the engine does), or
# the batch's sequences padded to a multiple of 8 (what row buckets finer than the
# engine's powers of two would give)
LOGIT_ROWS = ("engine", "all", "seqs")
_LOGIT_OPTIONS = {"alllogits": "all", "seqlogits": "seqs"}  # mode suffix -> LOGIT_ROWS
# mode suffix (and "no" + it) -> the KernelConfig switch it turns on (off)
_KERNEL_OPTIONS = {"dotmerge": "merge_dots", "fusedappend": "fused_append",
                   "cmdbuf": "command_buffers", "longestfirst": "decode_longest_first",
                   "fp8query": "decode_fp8_query"}
# mode suffix -> the mode's KV cache dtype (--kv-cache-dtype name), in place of the run's:
# bf16 and FP8 caches timed in one process
_KV_OPTIONS = {"bf16kv": "bf16", "fp8kv": "fp8"}
# the mode's dense projections quantized (layers/fp8.py); 'fp8static': with static
# activation scales calibrated on random token sequences (models/fp8_calibration.py);
# 'fp8block': per 128 x 128 block (the block-scaled GEMM)
_WEIGHT_OPTIONS = {"fp8w": "fp8", "fp8static": "fp8-static", "fp8block": "fp8-block"}
# mode suffix -> the mode's decode kernel (KernelConfig.decode_kernel)
_DECODE_OPTIONS = {"tritondecode": "triton", "mosaicdecode": "mosaic"}
# mode suffix -> who quantizes FP8 projections' inputs (KernelConfig.act_quant)
_ACT_QUANT_OPTIONS = {"fusedquant": "pallas", "xlaquant": "xla"}


def check_rows(batch: SyntheticBatch) -> np.ndarray:
    """_CHECK_ROWS sampling rows whose logits come back: spread over the decodes and over
    the prefill chunks, so every nano-batch has rows among them; the same rows whatever
    the mode's LM head rows, and always _CHECK_ROWS of them (one shape: one compile)."""
    d, n = batch.num_decodes, batch.num_seqs
    if 0 < d < n:
        k = min(_CHECK_ROWS // 4, n - d)
        rows = np.concatenate([np.linspace(0, d - 1, _CHECK_ROWS - k),
                               np.linspace(d, n - 1, k)])
    else:
        rows = np.linspace(0, n - 1, _CHECK_ROWS)
    return rows.round().astype(np.int32)


def make_step(forward):
    """The jitted iteration: forward over the dense batch, greedy sample per logit row;
    returns the sampled tokens and the logits of the rows `check` (check_rows)."""
    def step(params, kv, tokens, meta, logit_idx, check):
        logits, kv = forward(params, tokens, kv, meta, logit_idx)
        return kv, (jnp.argmax(logits, axis=-1), logits[check])
    return jax.jit(step, donate_argnums=(1,),
                   compiler_options=forward.compiler_options or None)


def with_logit_rows(batch: SyntheticBatch, how: str) -> SyntheticBatch:
    """The batch with the LM head rows of a mode (LOGIT_ROWS): the sampling rows are the
    same, only the padding rows (token 0's logits, as the engine pads) differ in number."""
    if how == "engine":
        return batch
    if how not in LOGIT_ROWS:
        raise ValueError(f"LM head rows {how!r} are not one of {LOGIT_ROWS}")
    n = len(batch.tokens) if how == "all" else -(-batch.num_seqs // 8) * 8
    idx = np.zeros(n, np.int32)
    idx[:batch.num_seqs] = batch.logit_idx[:batch.num_seqs]
    return dataclasses.replace(batch, logit_idx=idx)


def step_args(batch: SyntheticBatch) -> tuple:
    """The step's inputs after (params, kv)."""
    return batch.tokens, batch.meta, batch.logit_idx, check_rows(batch)


def time_step(step, params, kv, batch: SyntheticBatch, repeats: int = 10):
    """Median seconds of one step, each call from host inputs to its finished output;
    then the same steps issued back to back with their inputs already on the device and
    one wait at the end (seconds per step): the device-bound rate, which an engine that
    prepares the next batch while this one runs approaches (on the H200 the two differ by
    the input copies and the wait before the first kernel: bench/results/log/step.md). Returns
    (seconds, pipelined seconds, kv, sampled tokens of the batch's sequences and the
    checked rows' logits of the last call, those of the first). Every call sees the same
    cache contents (it rewrites the same slots with the same values), so a deterministic
    step returns the same output each time."""
    args = step_args(batch)
    kv, out = step(params, kv, *args)  # compile + warm up
    first = _sampled(batch, jax.device_get(out))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        kv, out = step(params, kv, *args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    on_device = jax.device_put(args)
    kv, out = step(params, kv, *on_device)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(repeats):
        kv, out = step(params, kv, *on_device)
    jax.block_until_ready(out)
    pipelined = (time.perf_counter() - t) / repeats
    return (float(np.median(times)), pipelined, kv, _sampled(batch, jax.device_get(out)),
            first)


def sustain_step(step, params, kv, batch: SyntheticBatch, seconds: float, sampler=None,
                 settle_s: float = 0.5):
    """The step back to back (inputs on the device, issued 5 at a time with the previous 5
    still queued, so the device never waits for the host) for settle_s,
    then for `seconds` more while `sampler` (profiling/pair_record.PowerSampler) records
    the SM clock, board power and throttle reasons: (kv, {"step_s", "steps", "seconds",
    "power": the sampler's summary or None}). On the H200 the step's GEMMs and its decode
    kernel each reach the 700 W cap alone (../shared/probes), so a 10-step burst may run
    faster than the rate a server holds; this is that rate, with the clock it ran at."""
    on_device = jax.device_put(step_args(batch))

    def run(until):
        nonlocal kv
        n, queued = 0, None
        while time.perf_counter() < until:
            for _ in range(5):
                kv, out = step(params, kv, *on_device)
            if queued is not None:
                jax.block_until_ready(queued)
            queued, n = out, n + 5
        jax.block_until_ready(queued)
        return n

    run(time.perf_counter() + settle_s)
    if sampler is not None:
        sampler.start()
    t = time.perf_counter()
    n = run(t + seconds)
    elapsed = time.perf_counter() - t
    power = sampler.stop() if sampler is not None else None
    return kv, {"step_s": elapsed / n, "steps": n, "seconds": elapsed, "power": power}


def _sampled(batch: SyntheticBatch, out):
    """A step's output restricted to the rows that sample (the padding rows' tokens are
    token 0's, however many there are): what two modes' outputs are compared on."""
    tokens, logits = out
    return tokens[:batch.num_seqs], logits


def mode_options() -> str:
    """The options a mode may carry after BASE[:SHARE], for error messages (from the same
    tables parse_mode reads)."""
    return ", ".join(["':nogroups'", "':keepinputs' or ':keepall'", "':gemmSHARE'",
                      "':xlagrouped'", "':shardmap'",
                      *(f"':[no]{o}'" for o in _KERNEL_OPTIONS),
                      *(" or ".join(f"':{o}'" for o in t)
                        for t in (_LOGIT_OPTIONS, _KV_OPTIONS, _DECODE_OPTIONS,
                                  _WEIGHT_OPTIONS))])


def parse_mode(mode: str) -> dict:
    """A step benchmark mode, BASE[:SHARE][:nogroups][:keepinputs|keepall][:gemmSHARE]
    [:xlagrouped][:dotmerge|nodotmerge][:fusedappend|nofusedappend][:cmdbuf|nocmdbuf]
    [:longestfirst|nolongestfirst][:fp8query|nofp8query][:alllogits|seqlogits][:bf16kv|fp8kv]
    [:tritondecode|mosaicdecode][:fp8w|fp8static|fp8block][:fusedquant|xlaquant]
    ('xlagrouped': an MoE step's expert GEMMs through XLA's ragged_dot instead of the Mosaic
    GPU grouped GEMM, the A/B of models/moe.py; 'dotmerge' / 'nodotmerge': XLA's dot merger
    on / off (KernelConfig.merge_dots); 'fusedappend' / 'nofusedappend': the cache written
    by the fused RoPE + append kernel or by XLA's scatters (KernelConfig.fused_append);
    'cmdbuf' / 'nocmdbuf': XLA command buffers on / off (KernelConfig.command_buffers);
    'longestfirst' / 'nolongestfirst': the swap-AB decode kernel's workers take the
    sequences longest first / in row order (KernelConfig.decode_longest_first);
    'fp8query' / 'nofp8query': with FP8 pages, the query in e4m3 too, QK^T an FP8 WGMMA
    (KernelConfig.decode_fp8_query);
    'alllogits': the LM head on all B_dense tokens, 'seqlogits': on the batch's sequences
    padded to a multiple of 8, instead of the engine's rows, the A/B of LOGIT_ROWS; with
    'seqlogits' each workload's row count is its own shape, compiled at its first call;
    'bf16kv' / 'fp8kv': the mode's KV cache in bf16 / FP8 whatever --kv-cache-dtype says;
    'tritondecode' / 'mosaicdecode': the mode's decode kernel, whatever --decode-kernel says;
    'fp8w': the mode's dense projections in FP8, quantized from the run's weights;
    'fp8static': the same with static activation scales (one per projection, calibrated
    on random token sequences through the float model), no per-token absmax;
    'fp8block': FP8 with block scales (128 x 128 weight blocks, 128-wide activation
    groups: pallas_kernels/block_fp8_matmul_mgpu.py);
    'fusedquant' / 'xlaquant': their inputs quantized by the fused RMSNorm and SiLU x up
    kernels / by XLA after them (KernelConfig.act_quant)):
    'overlap:0.25' runs the plan with every attention nano-op at share 0.25; 'nogroups'
    turns off the executor's XLA scheduling groups (the ablation that shows what they do);
    'shardmap' runs the step through the tensor-parallel shard_map path even at TP 1
    (nanojax/parallel/tp.py; the same-process A/B against today's path);
    'gemm0.5' gives every GEMM nano-op share 0.5 and bounds its grid (layers/matmul.py,
    whatever KernelConfig.gemm_shares says); 'keepinputs' makes side-stream regions return
    their inputs, 'keepall' every value computed inside them (PipelineForward's
    diagnostics). ValueError names a bad mode."""
    from nanojax.pipeline.plan import MODES
    base, *opts = mode.split(":")
    out = {"base": base, "attention_share": None, "gemm_share": None,
           "scheduling_groups": True, "keep": "", "xla_grouped": False, "shard_map": False,
           "logit_rows": "engine", **{name: None for name in _KERNEL_OPTIONS.values()},
           "kv_cache_dtype": None, "decode_kernel": None, "quantization": None,
           "act_quant": None}
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
            elif o == "xlagrouped":
                out["xla_grouped"] = True
            elif (name := _KERNEL_OPTIONS.get(o.removeprefix("no"))) and out[name] is None:
                out[name] = not o.startswith("no")
            elif o == "shardmap":  # the tensor-parallel path even at TP 1 (the A/B)
                out["shard_map"] = True
            elif o in _LOGIT_OPTIONS and out["logit_rows"] == "engine":
                out["logit_rows"] = _LOGIT_OPTIONS[o]
            elif o in _KV_OPTIONS and out["kv_cache_dtype"] is None:
                out["kv_cache_dtype"] = _KV_OPTIONS[o]
            elif o in _DECODE_OPTIONS and out["decode_kernel"] is None:
                out["decode_kernel"] = _DECODE_OPTIONS[o]
            elif o in _WEIGHT_OPTIONS and out["quantization"] is None:
                out["quantization"] = _WEIGHT_OPTIONS[o]
            elif o in _ACT_QUANT_OPTIONS and out["act_quant"] is None:
                out["act_quant"] = _ACT_QUANT_OPTIONS[o]
            else:
                raise ValueError
    except ValueError:
        raise ValueError(mode) from None
    if base not in MODES or any(s is not None and not 0 < s <= 1
                                for s in (out["attention_share"], out["gemm_share"])):
        raise ValueError(mode)
    if out["quantization"] == "fp8-static" and out["act_quant"] == "pallas":
        raise ValueError(f"{mode}: static scales need no per-token quantization to fuse")
    return out


def _variant(plan: dict, mode: str, kernels: KernelConfig):
    """The plan and PipelineForward arguments of a mode (parse_mode)."""
    m = parse_mode(mode)
    plan = copy.deepcopy(plan)
    for op in plan["nano_ops"]:
        share = m["attention_share"] if op["op"] == "attention" else m["gemm_share"]
        if share is not None:
            op["share"] = share
    if m["gemm_share"] is not None:
        kernels = kernels.replace(gemm_shares=True)
    if m["xla_grouped"]:
        kernels = kernels.replace(grouped_gemm="xla")
    if m["decode_kernel"] is not None:
        kernels = kernels.replace(decode_kernel=m["decode_kernel"])
    if m["act_quant"] is not None:
        kernels = kernels.replace(act_quant=m["act_quant"])
    for name in _KERNEL_OPTIONS.values():  # None: the run's KernelConfig
        if m[name] is not None:
            kernels = kernels.replace(**{name: m[name]})
    return plan, m["base"], dict(scheduling_groups=m["scheduling_groups"], keep=m["keep"],
                                 kernels=kernels, shard_map=m["shard_map"],
                                 logit_rows=m["logit_rows"], kv_cache_dtype=m["kv_cache_dtype"],
                                 quantization=m["quantization"])


def static_fp8_bundle(float_bundle, fp8_bundle, sequences: int = 8, length: int = 512):
    """fp8_bundle with static activation scales from the float model's activations on
    `sequences` random token sequences of `length` (seeded): what 'fp8static' times."""
    from nanojax.models.fp8_calibration import input_absmax, with_static_scales
    rng = np.random.default_rng(0)
    vocab = float_bundle.config.vocab_size
    seqs = [rng.integers(1, vocab, length).tolist() for _ in range(sequences)]
    return with_static_scales(fp8_bundle, input_absmax(float_bundle, seqs,
                                                       group=min(4, sequences)))


def f32_reference_outputs(bundle, plan: dict, batches: dict, num_pages: int,
                          page_size: int) -> dict:
    """workload -> (tokens, checked rows' logits) of the non-overlap step with weights,
    activations, KV cache and matmuls in float32 (highest precision: no TF32), on one
    device whatever the run's tensor parallelism."""
    from nanojax.pipeline.executor import PipelineForward
    from nanojax.pipeline.plan import single_device
    fwd = PipelineForward(bundle.config.replace(dtype="float32"), single_device(plan),
                          "non-overlap")
    one = jax.devices()[0]
    params = fwd.prepare(jax.tree_util.tree_map(
        lambda x: jax.device_put(x, one).astype(jnp.float32)
        if jnp.issubdtype(x.dtype, jnp.floating) else jax.device_put(x, one),
        bundle.params))
    step = make_step(fwd)
    out = {}
    with jax.default_matmul_precision("highest"):
        for w, b in batches.items():
            _, o = step(params, fwd.init_kv(num_pages, page_size), *step_args(b))
            out[w] = _sampled(b, jax.device_get(o))
    return out


def logits_distance(logits, ref_logits) -> float:
    """max |logits - ref| in standard deviations of ref: how two steps' numerics differ."""
    diff = np.abs(np.asarray(logits, np.float32) - np.asarray(ref_logits, np.float32))
    return float(np.max(diff) / np.std(np.asarray(ref_logits, np.float32)))


def tp_gemm_rate(cfg: ModelConfig, b_dense: int, tp: int) -> dict:
    """The GEMM rate of every GPU of the mesh, each measured on its own shard's GEMM shapes
    at B_dense; optimal tokens/s = their sum / (2 x the whole model's parameters)."""
    from nanojax.bench.roofline import measure_gemm_rate, optimal_tokens_per_s
    from nanojax.parallel.tp import TPLayout
    shard = TPLayout(cfg, tp).shard_config
    per = []
    for d in jax.devices()[:tp]:
        with jax.default_device(d):
            per.append(measure_gemm_rate(shard, b_dense)["gemm_flops_per_s"])
    rate = sum(per)
    return {"gemm_flops_per_s": rate, "per_device_gemm_flops_per_s": per,
            "optimal_tokens_per_s": optimal_tokens_per_s(cfg, rate)}


def _measure(step, fwd, params, batch: SyntheticBatch, num_pages: int, page_size: int,
             repeats: int, kv_dtype=None, sustain_s: float = 0.0,
             sampler=None) -> tuple[dict, tuple]:
    """Times one mode on one batch from a fresh cache: its row of the results (time,
    whether it repeats itself, with sustain_s the sustained rate and its clock and power)
    and its output (tokens, checked rows' logits)."""
    kv = fwd.init_kv(num_pages, page_size, kv_dtype)  # every mode: the same contents
    secs, pipelined, kv, out, first = time_step(step, params, kv, batch, repeats)
    sustained = None
    if sustain_s > 0:
        kv, sustained = sustain_step(step, params, kv, batch, sustain_s, sampler)
        sustained["tokens_per_s"] = len(batch.tokens) / sustained["step_s"]
        if (sustained["power"] or {}).get("samples"):  # what a power-capped step spends
            sustained["joules_per_token"] = (sustained["power"]["power_w_mean"]
                                             / sustained["tokens_per_s"])
    del kv
    return {"step_s": secs, "tokens_per_s": len(batch.tokens) / secs,
            **({"sustained": sustained} if sustained else {}),
            "pipelined_step_s": pipelined,
            "pipelined_tokens_per_s": len(batch.tokens) / pipelined,
            # the same step twice on the same inputs: a race shows up here
            "repeat_same_tokens": float(np.mean(first[0] == out[0])),
            "repeat_logits_max_abs_diff": float(np.max(np.abs(
                np.asarray(first[1], np.float32) - np.asarray(out[1], np.float32)))),
            "num_decodes": batch.num_decodes, "num_prefill_tokens": batch.num_prefill_tokens,
            "num_seqs": batch.num_seqs, "logit_rows": batch.rows,
            "kv_tokens_read_per_layer": batch.kv_tokens_read}, out


def _roofline_fields(r: dict, cfg, roof: dict, tp: int = 1) -> None:
    from nanojax.bench.roofline import CARD_TFLOPS, optimal_tokens_per_s
    r["fraction_of_optimal"] = r["tokens_per_s"] / roof["optimal_tokens_per_s"]
    r["pipelined_fraction_of_optimal"] = (r["pipelined_tokens_per_s"]
                                          / roof["optimal_tokens_per_s"])
    r["fraction_of_optimal_at_790_tflops"] = r["tokens_per_s"] / (
        optimal_tokens_per_s(cfg, tp * CARD_TFLOPS * 1e12))
    r["optimal_tokens_per_s"] = roof["optimal_tokens_per_s"]
    if "sustained" in r:
        r["sustained"]["fraction_of_optimal"] = (r["sustained"]["tokens_per_s"]
                                                 / roof["optimal_tokens_per_s"])
    r["gemm_tflops"] = roof["gemm_flops_per_s"] / 1e12


def _compare(r: dict, out, outputs: dict) -> None:
    """Do the modes compute the same function on the same batch? Against the first mode
    run, row by row, so a run cut short keeps the comparison."""
    ref_mode = next(iter(outputs))
    ref_tok, ref_logits = outputs[ref_mode]
    r["same_tokens_as_" + ref_mode] = float(np.mean(out[0] == ref_tok))
    # which sequences differ (decodes come first): where to look next
    r["differing_sequences"] = np.flatnonzero(out[0] != ref_tok)[:32].tolist()
    r["logits_max_diff_over_std"] = logits_distance(out[1], ref_logits)


def _capture_timeline(step, fwd, params, batch: SyntheticBatch, num_pages: int,
                      page_size: int, kv_dtype=None) -> list:
    from nanojax.profiling import timeline
    kv = fwd.init_kv(num_pages, page_size, kv_dtype)
    args = step_args(batch)
    kv, _ = step(params, kv, *args)  # warm: the trace holds one steady call
    holder = {}

    def once():
        holder["kv"], o = step(params, kv, *args)
        jax.block_until_ready(o)
    return timeline.capture(once)


def _write_timelines(timelines: dict, png: str, title: str) -> None:
    """The captured modes' events (PNG.events.json) and their plot (PNG)."""
    from nanojax.profiling import timeline
    Path(png).with_suffix(".events.json").write_text(json.dumps(timelines))
    try:
        timeline.plot(timelines, png, title)
    except ImportError:  # matplotlib absent: the events file can be plotted elsewhere
        pass


def _ratios(results: list, b_dense_list: list[int], workloads: list[str]) -> list[dict]:
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
            for m in t:  # same-process A/Bs against the plain base mode: the TP path at
                base = m.split(":")[0]  # TP 1 (issue 19), the LM head's rows, XLA options,
                opts = parse_mode(m)    # kernels (issues 17, 22)
                ab = (opts["shard_map"] or opts["xla_grouped"] or opts["logit_rows"] != "engine"
                      or opts["kv_cache_dtype"] is not None or opts["decode_kernel"]
                      or opts["quantization"] is not None or opts["act_quant"] is not None
                      or any(opts[k] is not None for k in _KERNEL_OPTIONS.values()))
                if ab and base in t and m != base:
                    row[f"{m}_over_{base}"] = t[m] / t[base]
            ratios.append(row)
    return ratios


def _add_f32_distance(results: list, b_dense: int, outputs: dict, ref: dict) -> None:
    for r in results:
        if r["b_dense"] == b_dense and "error" not in r:
            (tok, logits), (ref_tok, ref_logits) = (outputs[r["workload"]][r["mode"]],
                                                    ref[r["workload"]])
            r["same_tokens_as_f32"] = float(np.mean(tok == ref_tok))
            r["logits_max_diff_over_std_vs_f32"] = logits_distance(logits, ref_logits)


def run_step_bench(bundle, plan: dict, b_dense_list: list[int], workloads: list[str],
                   modes: list[str], page_size: int = 16, num_pages: int = 16384,
                   max_model_len: int = 2048, repeats: int = 10, timeline_png: str | None = None,
                   progress: bool = True, checkpoint=None, f32_reference: bool = False,
                   kernels: KernelConfig = KernelConfig(), tp: int = 1,
                   kv_cache_dtype: str = "auto", max_num_seqs: int | None = None,
                   sustain_s: float = 0.0) -> dict:
    """Every mode at every B_dense and workload, in one process: ratios between modes come
    from the same run. Optimal = the GEMM rate measured here at that B_dense.
    checkpoint(results) is called after every mode, so a run cut short keeps what it has.
    f32_reference: also run the step in float32 and say how far each mode's logits are
    from it (what a mode's difference from another must be measured against on a GPU,
    where each GEMM shape may get another kernel and so another rounding).
    kv_cache_dtype: the cache's element type (--kv-cache-dtype; the float32 reference
    keeps a float32 cache). max_num_seqs: the engine's sequence limit, whose row count
    the batches are padded to (engine_batch_rows; None: the most sequences of any
    workload's batch at that B_dense, the smallest limit that admits every batch).
    sustain_s: also run each mode and batch back to back this long with the SM clock and
    board power sampled (GPU 0, nvidia-smi; sustain_step)."""
    from tqdm.auto import tqdm

    from nanojax.bench.roofline import measure_gemm_rate
    from nanojax.layers.kv_fp8 import resolve_kv_cache_dtype
    from nanojax.models.bundle import quantize_bundle
    from nanojax.parallel.tp import TensorParallelForward
    from nanojax.pipeline.executor import PipelineForward
    from nanojax.pipeline.plan import resize
    from nanojax.profiling import timeline

    cfg = bundle.config
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, cfg.dtype)
    if any(parse_mode(m)["quantization"] == "fp8-static" for m in modes):  # before any timing
        if cfg.quantization is not None:
            raise ConfigError("':fp8static' calibrates the float model: load it without "
                              f"--quantization (it is {cfg.quantization})")
        cfg.replace(quantization="fp8", activation_scale="static")  # MoE: UnsupportedError
    max_pages = -(-max_model_len // page_size)
    # query blocks where the chunked-prefill kernel runs: the GPU (the CPU's pure-JAX
    # attention takes prefill tokens as rows)
    block_q = (kernels.prefill_block_q if kernels.prefill_kernel
               and jax.default_backend() == "gpu" else None)
    results, timelines = [], {}
    sampler = None
    if sustain_s > 0 and jax.default_backend() == "gpu":
        from nanojax.profiling.pair_record import PowerSampler
        sampler = PowerSampler(gpu_index=0, ms=50, settle_s=0.0)
    bar = tqdm(total=len(b_dense_list) * len(workloads) * len(modes), desc="steps",
               disable=not progress)
    prepared = {}  # plain or shard_map -> the parameters placed for it
    for b_dense in b_dense_list:
        roof = None
        if jax.default_backend() == "gpu":
            roof = measure_gemm_rate(cfg, b_dense) if tp == 1 else tp_gemm_rate(cfg, b_dense, tp)
        sized = resize(plan, b_dense)
        cuts = tuple(a for a, _ in sized["nano_batches"]["attention"][1:])
        lengths = {w: workload_lengths(w, max_model_len) for w in workloads}
        rows = engine_batch_rows(lengths, b_dense, cuts, max_num_seqs)
        batches = {w: synthetic_batch(cfg, b_dense, lengths[w], page_size, num_pages,
                                      max_pages, cuts, prefill_block_q=block_q,
                                      prefill_max_seqs=kernels.prefill_max_seqs, rows=rows)
                   for w in workloads}
        outputs = {}  # workload -> mode -> (tokens, checked logits)
        for mode in modes:
            p, base, options = _variant(sized, mode, kernels)
            shard = options.pop("shard_map")
            how = options.pop("logit_rows")
            mode_kv = options.pop("kv_cache_dtype")
            quant = options.pop("quantization") or cfg.quantization
            static = quant == "fp8-static"
            quant = "fp8" if static else quant
            mode_cfg = cfg.replace(quantization=quant,
                                   activation_scale="static" if static else cfg.activation_scale)
            mode_kv_dtype = (kv_dtype if mode_kv is None
                             else resolve_kv_cache_dtype(mode_kv, cfg.dtype))
            mode_batches = {w: with_logit_rows(b, how) for w, b in batches.items()}
            fwd = pipe = PipelineForward(mode_cfg, p, base, tp=tp, **options)
            kind = (tp > 1 or shard, mode_cfg.quantization, mode_cfg.activation_scale)
            if kind[0]:  # the tensor-parallel path (':shardmap' takes it at TP 1)
                fwd = TensorParallelForward(fwd, tp)
            if kind not in prepared:
                quantized = quantize_bundle(bundle, quant)
                if static:
                    quantized = static_fp8_bundle(bundle, quantized)
                prepared[kind] = fwd.prepare(quantized.params)
            params = prepared[kind]
            step = make_step(fwd)
            b0 = mode_batches[workloads[0]]
            t0 = time.perf_counter()
            try:
                kv_shape = jax.eval_shape(
                    lambda: fwd.init_kv(num_pages, page_size, mode_kv_dtype))
                step.lower(params, kv_shape, *step_args(b0)).compile()
            except Exception as e:  # record the mode's failure, measure the others
                results.append({"b_dense": b_dense, "mode": mode,
                                "error": f"{type(e).__name__}: {str(e)[:1500]}"})
                bar.update(len(workloads))
                continue
            compile_s = time.perf_counter() - t0
            for w in workloads:
                r, out = _measure(step, fwd, params, mode_batches[w], num_pages, page_size,
                                  repeats, mode_kv_dtype, sustain_s, sampler)
                r = {"b_dense": b_dense, "workload": w, "mode": mode, "rows": rows, **r,
                     "compile_s": compile_s}
                if tp > 1 and "sustained" in r:  # the sampler reads GPU 0 alone
                    r["sustained"].pop("joules_per_token", None)
                if pipe.fused_report:  # how each fused pair ran: one launch, or why not
                    r["fused_pairs"] = dict(pipe.fused_report)
                if roof:
                    _roofline_fields(r, cfg, roof, tp)
                outputs.setdefault(w, {})[mode] = out
                _compare(r, out, outputs[w])
                if timeline_png and b_dense == b_dense_list[0] and w == workloads[0]:
                    timelines[mode] = _capture_timeline(step, fwd, params, mode_batches[w],
                                                        num_pages, page_size, mode_kv_dtype)
                    r["timeline"] = timeline.summarize(timelines[mode])
                    # written as each mode is captured: a run cut by its limit keeps them
                    _write_timelines(timelines, timeline_png, f"one iteration, B_dense "
                                     f"{b_dense_list[0]}, workload {workloads[0]}")
                results.append(r)
                bar.update(1)
            del step, fwd
            if checkpoint:
                checkpoint({"partial": True, "results": results})
        if f32_reference:
            _add_f32_distance(results, b_dense, outputs, f32_reference_outputs(
                bundle, sized, batches, num_pages, page_size))
    bar.close()
    return {"results": results, "ratios": _ratios(results, b_dense_list, workloads)}
