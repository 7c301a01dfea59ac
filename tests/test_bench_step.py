"""The step benchmark's synthetic batch, the timeline analysis, and the PyTorch peer."""
import gzip
import json
import types

import jax
import numpy as np
import pytest

from nanojax.profiling import timeline
from nanojax.profiling.synthetic import steady_state_mix, synthetic_batch, workload_lengths
from nanojax.config import named_shape


def test_steady_state_mix_follows_the_workload():
    rng = np.random.default_rng(0)
    contexts, chunks = steady_state_mix([(300, 100)], 1024, rng, cuts=(512, 700))
    assert len(contexts) == 256  # a request spends 100 of its 400 tokens decoding
    assert all(301 <= c <= 400 for c in contexts)
    assert len(contexts) + sum(chunks) == 1024
    ends = np.cumsum([len(contexts)] + chunks)
    assert 512 in ends and 700 in ends  # chunks end at the cuts


def test_synthetic_batch_writes_only_pages_nobody_else_reads():
    cfg = named_shape("tiny")
    b = synthetic_batch(cfg, 256, workload_lengths("sharegpt", 512), page_size=16,
                        num_pages=2048, max_pages=32, cuts=(128,))
    m = b.meta
    written = m.slot_mapping // 16
    assert len(set(m.slot_mapping.tolist())) == 256  # no slot written twice
    rows = np.unique(m.seq_ids)
    for row in rows:  # pages a row reads but does not write are never written by anyone
        read = set(m.page_table[row, :-(-int(m.context_lens[row]) // 16)].tolist())
        own = set(written[m.seq_ids == row].tolist())
        assert not (read - own) & set(written.tolist())
    # no sequence straddles the cut
    assert not set(m.seq_ids[:128].tolist()) & set(m.seq_ids[128:].tolist())
    assert b.num_decodes + b.num_prefill_tokens == 256


def _two_batch_plan(cfg, b_dense=64):
    half = b_dense // 2
    return {"version": 1, "model": cfg.signature(), "tp": 1, "b_dense": b_dense,
            "granularity": 8,
            "nano_batches": {g: [[0, half], [half, b_dense]]
                             for g in ("qkv", "attention", "o_proj", "mlp")},
            "nano_ops": [{"op": g, "batch": b, "stream": int(g == "attention")}
                         for b in (0, 1) for g in ("qkv", "attention", "o_proj", "mlp")]}


def _engine_batch(cfg, workload="48/16", b_dense=64, cuts=(32,), **kw):
    """The step bench's batch of a workload: 16 decodes and two prefill chunks (18
    sequences in 64 tokens), padded to the CPU engine's rows."""
    from nanojax.profiling.synthetic import engine_batch_rows
    lengths = workload_lengths(workload, 256)
    rows = engine_batch_rows({workload: lengths}, b_dense, cuts, on_gpu=False)
    return synthetic_batch(cfg, b_dense, lengths, page_size=16, num_pages=512,
                           max_pages=16, cuts=cuts, rows=rows, **kw)


def test_synthetic_batch_has_the_engines_rows():
    """Per-sequence arrays have the runner's row count for an engine that admits the
    batch (not one row per token), padded as the runner pads: zeros."""
    from checkpoints.loader import load_model
    from nanojax.config import EngineConfig, Platform
    from nanojax.engine.runner import ModelRunner
    bundle = load_model("random:tiny")
    b = _engine_batch(bundle.config, prefill_block_q=8, prefill_max_seqs=4)
    assert (b.num_seqs, b.num_decodes, len(b.tokens)) == (18, 16, 64)
    scheduled = types.SimpleNamespace(entries=[None] * b.num_seqs, num_tokens=64)
    for fixed, rows in ((False, 32), (True, 64)):  # this step's rows, or every step's
        config = EngineConfig(b_dense=64, fixed_shapes=fixed).resolve(Platform(False, 132, 2))
        runner = ModelRunner(bundle.config, bundle.params, config, num_pages=512,
                             max_rows=b.num_seqs, max_model_len=16 * 16)
        # a varying row count pads to a power of two, one row shape to a multiple of 64
        assert runner.shapes_for(scheduled)[1] == rows
    assert b.rows == 32  # the CPU engine's rows (no fixed shapes there)
    m = b.meta
    assert m.page_table.shape[0] == m.context_lens.shape[0] == len(b.logit_idx) == 32
    # sampling rows take their sequence's last token; padding rows, token 0 and no pages
    idx = b.logit_idx[:b.num_seqs]
    assert (m.seq_ids[idx] == np.arange(b.num_seqs)).all()
    assert (m.positions[idx] + 1 == m.context_lens[:b.num_seqs]).all()
    assert not b.logit_idx[18:].any() and not m.page_table[18:].any()
    assert not m.context_lens[18:].any()
    # query blocks bounded as the runner bounds them: T // block_q + min(rows, max_seqs)
    assert m.prefill_blocks.shape[0] == 64 // 8 + 4
    with pytest.raises(ValueError, match="cannot hold"):
        synthetic_batch(bundle.config, 64, workload_lengths("48/16", 256), 16, 512, 16,
                        (32,), rows=16)


def test_step_bench_refuses_a_sequence_limit_below_the_batch():
    from nanojax.errors import NanojaxError
    from nanojax.profiling.synthetic import engine_batch_rows as batch_rows
    lengths = {"48/16": workload_lengths("48/16", 256)}
    assert batch_rows(lengths, 64, (32,), on_gpu=False) == 32  # 18 sequences
    assert batch_rows(lengths, 64, (32,), on_gpu=True) == 64  # one row shape: 64s
    assert batch_rows(lengths, 64, (32,), max_num_seqs=40, on_gpu=True) == 64
    assert batch_rows(lengths, 64, (32,), max_num_seqs=1000, on_gpu=True) == 64  # <= B_dense
    with pytest.raises(NanojaxError, match="--max-num-seqs 10 is below the 18 sequences"):
        batch_rows(lengths, 64, (32,), max_num_seqs=10)


def _dots_over_vocab(jaxpr, vocab):
    """(lhs shape, rhs shape) of every dot_general with an operand spanning the
    vocabulary, in the jaxpr and the jaxprs inside it."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes = [v.aval.shape for v in eqn.invars]
            if any(vocab in s for s in shapes):
                out.append(tuple(shapes))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _dots_over_vocab(inner, vocab)
    return out


def test_the_lm_head_runs_on_the_engines_rows_not_every_token():
    """The step bench's LM head GEMM, read from its jaxpr: engine rows (32 for 18
    sequences on the CPU), B_dense rows (64) only under ':alllogits', 24 under
    ':seqlogits'."""
    import jax
    from checkpoints.loader import load_model
    from nanojax.bench.step import make_step, step_args, with_logit_rows
    from nanojax.pipeline.executor import PipelineForward
    bundle = load_model("random:tiny")
    cfg = bundle.config
    fwd = PipelineForward(cfg, _two_batch_plan(cfg), "non-overlap")
    params, kv = fwd.prepare(bundle.params), fwd.init_kv(512, 16)
    step = make_step(fwd)
    batch = _engine_batch(cfg)
    for how, rows in (("engine", 32), ("all", 64), ("seqs", 24)):
        b = with_logit_rows(batch, how)
        jaxpr = jax.make_jaxpr(step)(params, kv, *step_args(b)).jaxpr
        dots = _dots_over_vocab(jaxpr, cfg.vocab_size)
        assert dots == [((rows, cfg.hidden_size), (cfg.hidden_size, cfg.vocab_size))], how
        kv_out, (tokens, logits) = jax.eval_shape(step, params, kv, *step_args(b))
        assert tokens.shape == (rows,) and logits.shape == (64, cfg.vocab_size)


def test_the_logit_rows_ab_samples_the_same_tokens():
    """':alllogits' and ':seqlogits' against the engine's rows in one run: the same
    tokens for every sequence, the same checked logits, each mode's LM head rows
    recorded, and their ratio to the plain mode."""
    from checkpoints.loader import load_model
    from nanojax.bench.step import run_step_bench
    bundle = load_model("random:tiny")
    modes = ["non-overlap", "non-overlap::alllogits", "non-overlap::seqlogits"]
    out = run_step_bench(bundle, _two_batch_plan(bundle.config), [64], ["48/16"], modes,
                         num_pages=512, max_model_len=256, repeats=1, progress=False)
    res = {r["mode"]: r for r in out["results"]}
    assert [res[m]["logit_rows"] for m in modes] == [32, 64, 24]
    for r in res.values():
        assert r["rows"] == 32 and r["num_seqs"] == 18
        # the step timed both ways: synced per call, and issued back to back
        assert r["step_s"] > 0 and r["pipelined_step_s"] > 0
        assert r["pipelined_tokens_per_s"] == pytest.approx(64 / r["pipelined_step_s"])
        assert r["same_tokens_as_non-overlap"] == 1.0 and r["differing_sequences"] == []
        assert r["logits_max_diff_over_std"] < 1e-5
    ratios = out["ratios"][0]
    assert {"non-overlap::alllogits_over_non-overlap",
            "non-overlap::seqlogits_over_non-overlap"} <= set(ratios)


def test_the_fp8kv_mode_runs_with_an_fp8_cache():
    """':fp8kv' times the mode on an FP8 cache in the same run as the model-dtype one:
    its logits move off the plain mode's by e4m3's rounding, not more."""
    from checkpoints.loader import load_model
    from nanojax.bench.step import run_step_bench
    bundle = load_model("random:tiny")
    out = run_step_bench(bundle, _two_batch_plan(bundle.config), [64], ["48/16"],
                         ["non-overlap", "non-overlap::fp8kv"], num_pages=512,
                         max_model_len=256, repeats=1, progress=False, sustain_s=0.05)
    plain, fp8 = out["results"]
    assert plain["logits_max_diff_over_std"] == 0.0
    for r in (plain, fp8):  # the rate held back to back (no nvidia-smi here: no power)
        s = r["sustained"]
        assert s["steps"] >= 5 and s["seconds"] >= 0.05 and s["power"] is None
        assert s["tokens_per_s"] == pytest.approx(64 / s["step_s"])
    assert 1e-4 < fp8["logits_max_diff_over_std"] < 0.5
    assert "non-overlap::fp8kv_over_non-overlap" in out["ratios"][0]


def test_the_fp8w_mode_runs_fp8_weights_beside_the_float_ones():
    """':fp8w' quantizes the run's weights for that mode alone (W8A8, layers/fp8.py): its
    logits move off the float mode's by e4m3's rounding, not more, and with ':fp8kv' on
    top further still; ':fp8static' with calibrated static activation scales; the float
    mode is untouched."""
    from checkpoints.loader import load_model, quantize_bundle
    from nanojax.bench.step import parse_mode, run_step_bench
    assert parse_mode("non-overlap::fp8w:fp8kv")["quantization"] == "fp8"
    assert parse_mode("non-overlap::fp8w:fusedquant")["act_quant"] == "pallas"
    assert parse_mode("non-overlap::fp8static")["quantization"] == "fp8-static"
    bundle = load_model("random:tiny")
    modes = ["non-overlap", "non-overlap::fp8w", "non-overlap::fp8w:fp8kv",
             "non-overlap::fp8static"]
    out = run_step_bench(bundle, _two_batch_plan(bundle.config), [64], ["48/16"], modes,
                         num_pages=512, max_model_len=256, repeats=1, progress=False)
    plain, w8, w8kv, static = out["results"]
    assert plain["logits_max_diff_over_std"] == 0.0
    assert 1e-3 < w8["logits_max_diff_over_std"] < 0.5
    assert w8kv["logits_max_diff_over_std"] != w8["logits_max_diff_over_std"]
    # one scale per projection: a rounding of its own, near the per-token one
    assert 1e-3 < static["logits_max_diff_over_std"] < 0.5
    assert static["logits_max_diff_over_std"] != w8["logits_max_diff_over_std"]
    from nanojax.errors import NanojaxError  # refused before any mode is timed
    for b, msg in ((quantize_bundle(bundle, "fp8"), "without --quantization"),
                   (load_model("random:tiny-moe"), "MoE")):
        with pytest.raises(NanojaxError, match=msg):
            run_step_bench(b, _two_batch_plan(b.config), [64], ["48/16"],
                           ["non-overlap::fp8static"], num_pages=512, max_model_len=256,
                           repeats=1, progress=False)
    assert "non-overlap::fp8w_over_non-overlap" in out["ratios"][0]


def test_step_bench_modes_agree_on_the_cpu(tmp_path):
    from checkpoints.loader import load_model
    from nanojax.bench.step import run_step_bench
    bundle = load_model("random:tiny")
    plan = {"version": 1, "model": bundle.config.signature(), "tp": 1, "b_dense": 64,
            "granularity": 8,
            "nano_batches": {g: [[0, 32], [32, 64]]
                             for g in ("qkv", "attention", "o_proj", "mlp")},
            "nano_ops": [{"op": "qkv", "batch": 1}, {"op": "attention", "batch": 1,
                                                     "stream": 1, "share": 0.5},
                         {"op": "qkv", "batch": 0}, {"op": "attention", "batch": 0,
                                                     "stream": 1},
                         {"op": "o_proj", "batch": 1}, {"op": "mlp", "batch": 1},
                         {"op": "o_proj", "batch": 0}, {"op": "mlp", "batch": 0}]}
    saved, drawn = [], []
    events_file = tmp_path / "t.events.json"

    def checkpoint(partial):  # what a run cut after this mode would keep
        saved.append(partial)
        drawn.append(sorted(json.loads(events_file.read_text())))
    modes = ["non-overlap", "overlap", "overlap:0.25:nogroups:gemm0.5",
             "overlap:1.0:keepinputs", "overlap:1.0:keepall"]
    out = run_step_bench(bundle, plan, [64], ["32/32"], modes,
                         num_pages=512, max_model_len=256, repeats=1, progress=False,
                         timeline_png=str(tmp_path / "t.png"), checkpoint=checkpoint,
                         f32_reference=True)
    assert len(saved) == len(modes) and saved[-1]["partial"]
    assert drawn[0] == ["non-overlap"] and drawn[1] == ["non-overlap", "overlap"]
    for r in out["results"]:
        assert r["same_tokens_as_non-overlap"] == 1.0
        assert r["logits_max_diff_over_std"] < 1e-4
        assert r["repeat_same_tokens"] == 1.0 and r["repeat_logits_max_abs_diff"] == 0.0
        # the tiny model is float32 already: the reference is the same computation
        assert r["same_tokens_as_f32"] == 1.0 and r["logits_max_diff_over_std_vs_f32"] < 1e-4
        assert r["timeline"]["span_us"] > 0
    assert "overlap_over_non_overlap" in out["ratios"][0]
    assert (tmp_path / "t.png").stat().st_size > 10_000
    events = json.loads(events_file.read_text())
    assert set(events) == set(modes)


def test_step_modes_parse_into_their_options():
    from nanojax.bench.step import parse_mode
    m = parse_mode("overlap:0.25:nogroups:gemm0.5:keepinputs")
    assert m == {"base": "overlap", "attention_share": 0.25, "gemm_share": 0.5,
                 "scheduling_groups": False, "keep": "inputs", "xla_grouped": False,
                 "shard_map": False, "logit_rows": "engine", "merge_dots": None,
                 "fused_append": None, "command_buffers": None,
                 "decode_longest_first": None, "decode_fp8_query": None,
                 "kv_cache_dtype": None, "decode_kernel": None,
                 "quantization": None, "act_quant": None}
    assert parse_mode("non-overlap::alllogits")["logit_rows"] == "all"
    assert parse_mode("overlap:0.5:seqlogits")["logit_rows"] == "seqs"
    assert parse_mode("overlap:1.0:keepall")["keep"] == "values"
    assert parse_mode("non-overlap::shardmap")["shard_map"]
    assert parse_mode("non-overlap")["attention_share"] is None
    assert parse_mode("non-overlap")["xla_grouped"] is False
    assert parse_mode("non-overlap::xlagrouped")["xla_grouped"] is True
    assert parse_mode("non-overlap::nodotmerge")["merge_dots"] is False
    assert parse_mode("non-overlap::dotmerge")["merge_dots"] is True
    assert parse_mode("non-overlap::longestfirst")["decode_longest_first"] is True
    from nanojax.bench.step import _variant
    from nanojax.config import KernelConfig
    _, _, options = _variant({"nano_ops": []}, "non-overlap::longestfirst",
                             KernelConfig(decode_longest_first=False))
    assert options["kernels"].decode_longest_first
    _, _, options = _variant({"nano_ops": []}, "non-overlap::nolongestfirst", KernelConfig())
    assert not options["kernels"].decode_longest_first  # the default is on
    assert parse_mode("non-overlap::fusedappend")["fused_append"] is True
    assert parse_mode("non-overlap::nofusedappend")["fused_append"] is False
    assert parse_mode("non-overlap::cmdbuf")["command_buffers"] is True
    assert parse_mode("non-overlap::fp8kv")["kv_cache_dtype"] == "fp8"
    assert parse_mode("overlap::bf16kv:cmdbuf")["kv_cache_dtype"] == "bf16"
    assert parse_mode("non-overlap::fp8kv:mosaicdecode")["decode_kernel"] == "mosaic"
    _, _, options = _variant({"nano_ops": []}, "non-overlap::fp8kv:fp8query", KernelConfig())
    assert options["kernels"].decode_fp8_query and not KernelConfig().decode_fp8_query
    from nanojax.bench.step import _ratios  # an option's A/B gets its ratio to the base
    rows = [{"b_dense": 64, "workload": "w", "mode": m, "tokens_per_s": tps} for m, tps in
            (("non-overlap", 100.0), ("non-overlap::cmdbuf", 110.0),
             ("non-overlap::nodotmerge:nofusedappend", 90.0), ("non-overlap::fp8kv", 120.0))]
    assert _ratios(rows, [64], ["w"])[0] == {
        "b_dense": 64, "workload": "w", "non-overlap::cmdbuf_over_non-overlap": 1.1,
        "non-overlap::nodotmerge:nofusedappend_over_non-overlap": 0.9,
        "non-overlap::fp8kv_over_non-overlap": 1.2}
    for bad in ("overlap:0", "overlap:0.5:foo", "overlap::gemm2", "sideways",
                "overlap:1.0:keepinputs:keepall", "non-overlap::alllogits:seqlogits",
                "non-overlap::somelogits", "non-overlap::dotmerge:nodotmerge",
                "non-overlap::fp8kv:bf16kv", "non-overlap::tritondecode:mosaicdecode"):
        with pytest.raises(ValueError, match=bad):
            parse_mode(bad)


def _event(stream, kind, start, dur):
    return {"stream": stream, "name": kind, "hlo_op": "", "kind": kind,
            "start_us": start, "dur_us": dur}


def test_timeline_summary_measures_overlap():
    ev = [_event("s0", "gemm", 0, 100), _event("s1", "attention", 50, 100),
          _event("s0", "gemm", 120, 20), _event("s0", "other", 140, 10)]
    s = timeline.summarize(ev)
    assert s["span_us"] == 150
    # attention [50, 150) lies under GEMMs during [50, 100) and [120, 140): 70 of 100
    assert s["attention_overlapped_by_gemm"] == pytest.approx(0.7)
    assert s["busy_fraction"]["gemm"] == pytest.approx(120 / 150)
    assert s["kernel_us"]["attention"] == 100
    assert s["attention_in_fused_pair"] == 0.0


def test_timeline_summary_counts_fused_pairs():
    """The overlap mode's fused launch runs attention beside a GEMM in one kernel: the
    summary says how much of the attention-carrying time that was."""
    ev = [_event("s0", "gemm", 0, 100), _event("s0", "pair", 100, 60),
          _event("s0", "attention", 160, 20), _event("s0", "other", 180, 10)]
    s = timeline.summarize(ev)
    assert s["attention_in_fused_pair"] == pytest.approx(60 / 80)
    assert s["attention_overlapped_by_gemm"] == 0.0  # nothing on another stream
    assert s["busy_fraction"]["pair"] == pytest.approx(60 / 190)


def test_trace_parser_reads_gpu_streams(tmp_path):
    trace = {"traceEvents": [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name",
         "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 1000, "dur": 5, "name": "nvjet_sm90_tss_x",
         "args": {"hlo_op": "custom-call.1"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 1010, "dur": 9, "name": "paged_decode_attention",
         "args": {"hlo_op": "custom-call.2"}},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 900, "dur": 50, "name": "host work",
         "args": {"hlo_op": "x"}}]}
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    ev = timeline.parse_trace(str(path))
    assert [(e["kind"], e["start_us"], e["stream"]) for e in ev] == [
        ("gemm", 0.0, "Stream #14(Compute)"), ("attention", 10.0, "Stream #14(Compute)")]


def test_dot_merger_off_is_an_xla_option_of_the_gpu_step():
    """KernelConfig.merge_dots=False (the default): the GPU step compiles with XLA's dot
    merger off (it concatenated the q/k/v weights on every step: ~25 us a layer on the
    H200); the option name is one XLA knows (an unknown one fails to compile); the CPU step
    is untouched."""
    from nanojax.config import KernelConfig
    from nanojax.engine.forward import gpu_compiler_options
    from nanojax.pipeline.executor import PipelineForward
    off = KernelConfig()
    assert "xla_gpu_dot_merger_threshold_mb" not in gpu_compiler_options(
        KernelConfig(merge_dots=True), "gpu")
    assert gpu_compiler_options(off, "cpu") == {}
    options = {k: v for k, v in gpu_compiler_options(off, "gpu").items()
               if k == "xla_gpu_dot_merger_threshold_mb"}
    assert options == {"xla_gpu_dot_merger_threshold_mb": 0}
    f = jax.jit(lambda a, b, c: (a @ b, a @ c), compiler_options=options)
    assert float(f(*[np.ones((4, 4), np.float32)] * 3)[1][0, 0]) == 4.0
    cfg = named_shape("tiny")  # on the CPU: no GPU option in either forward
    assert PipelineForward(cfg, _two_batch_plan(cfg), kernels=off).compiler_options == {}


def test_command_buffers_are_an_xla_option_of_a_step_without_side_streams():
    """KernelConfig.command_buffers: the GPU step compiles with XLA's command buffers on
    (the value is one XLA parses: a bad one fails to compile), unless it has regions on
    other streams, whose concurrency a command buffer would serialise."""
    from nanojax.config import KernelConfig
    from nanojax.engine.forward import COMMAND_BUFFER_TYPES, gpu_compiler_options
    on = KernelConfig(command_buffers=True)
    key = "xla_gpu_enable_command_buffer"
    # off is explicit (XLA's default is on; the CLI's flags are not there for Python users)
    assert gpu_compiler_options(KernelConfig(), "gpu")[key] == ""
    assert gpu_compiler_options(on, "gpu")[key] == COMMAND_BUFFER_TYPES
    assert gpu_compiler_options(on, "gpu", side_streams=True)[key] == ""
    assert gpu_compiler_options(on, "cpu") == {}
    f = jax.jit(lambda a: a @ a, compiler_options={key: COMMAND_BUFFER_TYPES})
    assert float(f(np.ones((4, 4), np.float32))[0, 0]) == 4.0
    with pytest.raises(Exception, match="not a valid enum"):
        jax.jit(lambda a: a @ a, compiler_options={key: "BOGUS"})(np.ones((4, 4)))


def test_a_plan_forward_keeps_command_buffers_off_only_with_side_streams(monkeypatch):
    """PipelineForward on a GPU: the overlap mode places attention on stream 1 (command
    buffers off); its ablations, streams turned off and a plan on one stream keep them."""
    from nanojax.config import KernelConfig
    from nanojax.pipeline import executor
    from nanojax.pipeline.executor import PipelineForward
    monkeypatch.setattr(executor.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(executor, "streams_enabled", lambda enabled=True: enabled)
    cfg, on = named_shape("tiny"), KernelConfig(command_buffers=True)
    key = "xla_gpu_enable_command_buffer"

    def options(plan, mode, kernels=on):
        return PipelineForward(cfg, plan, mode, kernels=kernels).compiler_options[key]
    plan = _two_batch_plan(cfg)
    assert options(plan, "overlap") == ""
    assert options(plan, "non-overlap") != "" and options(plan, "nanobatch-only") != ""
    assert options(plan, "overlap", on.replace(streams=False)) != ""
    one_stream = _two_batch_plan(cfg)
    for op in one_stream["nano_ops"]:
        op["stream"] = 0
    assert options(one_stream, "overlap") != ""


@pytest.mark.parametrize("name,kind", [
    ("decode_attention_swapab_mosaic_gpu_kernel", "attention"),
    ("_lambda__mosaic_gpu_kernel", "attention"),  # the swap-AB kernel before it was named
    ("fused_gemm_attention_mosaic_gpu_kernel", "pair"),
    ("body_mosaic_gpu_kernel", "gemm"),  # jax's grouped GEMM (MoE experts), unnamed
    ("matmul_mgpu_mosaic_gpu_kernel", "gemm"), ("fused_pair_gemm_mosaic_gpu_kernel", "gemm"),
    ("paged_decode_attention", "attention"), ("nvjet_sm90_tst_128x256", "gemm"),
    ("loop_multiply_fusion", "other")])
def test_kernels_are_told_apart_by_name(name, kind):
    """A Mixtral timeline has two Mosaic GPU kernels a layer: the expert GEMMs and the
    decode attention (all Mosaic kernels counted as attention once made 87% of a Mixtral
    decode iteration 'attention', bench/results/log/moe.md)."""
    assert timeline.classify(name) == kind


def test_peer_runs_transformers_continuous_batching():
    pytest.importorskip("transformers")
    from nanojax.bench.peer import run_peer
    r = run_peer("tiny", num_prompts=3, input_len=12, output_len=4, trace=None,
                 max_model_len=64)
    assert r["requests"] == 3 and r["prompt_tokens"] == 36
    assert r["output_tokens"] == 12  # EOS is off: every request runs to max_new_tokens
    assert r["total_tokens_per_s"] == pytest.approx(48 / r["wall_s"])


def test_throughput_bench_compares_modes_in_one_run(tmp_path):
    """`nanojax bench --plan`: every mode's tokens/s, their ratio, identical outputs, and
    how full the dense batches were."""
    from nanojax.cli import main
    cfg = named_shape("tiny")
    plan = {"version": 1, "model": cfg.signature(), "tp": 1, "b_dense": 32,
            "nano_batches": {g: [[0, 16], [16, 32]]
                             for g in ("qkv", "attention", "o_proj", "mlp")},
            "nano_ops": [{"op": g, "batch": b, "stream": int(g == "attention")}
                         for b in (0, 1) for g in ("qkv", "attention", "o_proj", "mlp")]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "r.json"
    assert main(["bench", "--model", "random:tiny", "--plan", str(tmp_path / "plan.json"),
                 "--modes", "non-overlap,overlap", "--b-dense", "32", "--constant-batch",
                 "--num-prompts", "12", "--input-len", "20", "--output-len", "6",
                 "--max-model-len", "64", "--quiet", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    res = r["results"]
    assert r["overlap_over_non_overlap"] == pytest.approx(
        res["overlap"]["total_tokens_per_s"] / res["non-overlap"]["total_tokens_per_s"])
    # the record says what ran: the full engine config and the XLA flags
    assert r["config"]["b_dense"] == 32 and r["config"]["constant_batch"] is True
    assert r["config"]["kernels"]["decode_kernel"] == "auto" and "xla_flags" in r["env"]
    for mode in ("non-overlap", "overlap"):
        m = r["results"][mode]
        assert m["output_tokens"] == 12 * 6 and m["prompt_tokens"] == 12 * 20
        assert m["same_outputs_as_non-overlap"] == 1.0
        assert 0 < m["mean_batch_fill"] <= 1 and m["iterations"] > 0
        # host work and device waits are parts of the run's wall time
        assert m["host_ms_per_iteration"] > 0 and 0 <= m["device_wait_share"] < 1
        assert m["host_ms_per_iteration"] * m["iterations"] / 1e3 < m["wall_s"]


@pytest.mark.parametrize("argv,msg", [
    (["bench", "step", "--model", "random:tiny", "--plan", "llama3-8b-1gpu",
      "--modes", "overlap:2"], "bad --b-dense or --modes"),
    (["bench", "step", "--model", "random:tiny", "--plan", "llama3-8b-1gpu",
      "--b-dense", "x"], "B_dense values are integers"),
    (["bench", "step", "--model", "random:tiny", "--plan", "llama3-8b-1gpu",
      "--modes", "overlap:0.5:gemm1.5"], "':gemmSHARE'"),
    (["bench", "step", "--model", "random:tiny", "--plan", "llama3-8b-1gpu",  # each option
      "--modes", "non-overlap::longestfirst:longestfirst"], "':[no]longestfirst'"),  # once
    *((["bench", "step", "--model", "random:tiny", "--plan", "llama3-8b-1gpu",
        "--sustain-seconds", x], "--sustain-seconds must be in") for x in ("nan", "inf", "-1")),
    (["profile", "--model", "random:tiny", "--granularity", "0", "--out", "p.json"],
     "positive multiple of --granularity"),
    (["profile", "--model", "random:tiny", "--shares", "a", "--out", "p.json"],
     "--shares must be numbers"),
    (["profile", "--model", "random:tiny", "--pair-shares", "66,x", "--out", "p.json"],
     "--pair-shares must be positive integers"),
    (["profile", "--model", "random:tiny", "--pair-shares", "66", "--pair-gemms", "gate,up",
      "--out", "p.json"], "--pair-gemms: unknown ['gate', 'up']"),
    (["profile", "--model", "random:tiny", "--pair-shares", "66", "--kv-cache-dtype", "fp8",
      "--out", "p.json"], "reads bf16 pages only"),
    (["bench", "step", "--model", "random:tiny", "--plan", "llama3-8b-1gpu",
      "--modes", "non-overlap::fp8static:fusedquant"], "bad --b-dense or --modes"),
])
def test_bench_and_profile_refuse_bad_arguments_before_loading(argv, msg, capsys):
    from nanojax.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:
        rc, err = e.code, str(e.code)
    else:
        err = capsys.readouterr().err
    assert rc not in (0, None) and msg in err


def test_prediction_check_takes_the_layer_time_from_two_layer_counts(tmp_path):
    """bench/repro/overlap_search/prediction_check.py: (t[8] - t[4]) / 4 per layer, the rest
    non-layer."""
    import json
    import subprocess
    import sys
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"predicted": {"makespan_s": 0.0025}}))
    for layers, secs in ((4, 0.0145), (8, 0.0255)):  # 2.75 ms per layer, 3.5 ms outside
        (tmp_path / f"s{layers}.json").write_text(json.dumps(
            {"num_layers": layers, "results": [{"mode": "overlap", "step_s": secs}]}))
    out = tmp_path / "check.json"
    subprocess.run([sys.executable, "bench/repro/overlap_search/prediction_check.py", str(plan),
                    str(tmp_path / "s8.json"), str(tmp_path / "s4.json"), "--out", str(out)],
                   check=True, capture_output=True)
    res = json.loads(out.read_text())
    assert abs(res["measured_layer_s"] - 0.00275) < 1e-12
    assert abs(res["non_layer_s"] - 0.0035) < 1e-12
    assert abs(res["predicted_over_measured_minus_1"] - (0.0025 / 0.00275 - 1)) < 1e-12
    assert res["within_tolerance"]


def test_merge_throughput_takes_ratios_from_rows_of_one_process(tmp_path):
    """bench/repro/step/merge_throughput.py: a step file cut short by its time limit has rows
    but no ratios; the merge computes them per run, never across runs."""
    import json
    import subprocess
    import sys

    def row(b, mode, tps):
        return {"b_dense": b, "workload": "512/512", "mode": mode, "step_s": b / tps,
                "tokens_per_s": tps, "fraction_of_optimal": tps / 40000}
    for run, rows in (("a", [row(2048, "non-overlap", 20000), row(2048, "overlap", 25000)]),
                      ("b", [row(2048, "non-overlap", 30000)])):
        (tmp_path / run).mkdir()
        (tmp_path / run / "step_2048.json").write_text(json.dumps(
            {"command": f"nanojax bench step {run}", "partial": run == "b", "results": rows}))
    (tmp_path / "a" / "peer_128.json").write_text(json.dumps({"total_tokens_per_s": 1000.0}))
    (tmp_path / "c").mkdir()  # engine runs only: one beside the peer, one in another call
    wl = {"num_prompts": 128, "input_len": 512, "output_len": 512}
    for name, tps, peer in (("engine_peer.json", 1500.0, {"total_tokens_per_s": 1200.0}),
                            ("engine_warm.json", 12000.0, None)):
        (tmp_path / "c" / name).write_text(json.dumps(
            {"command": f"nanojax bench {name}", "workload": wl, "peer": peer,
             "results": {"async": {"total_tokens_per_s": tps}}}))
    out = tmp_path / "m.json"
    subprocess.run([sys.executable, "bench/repro/step/merge_throughput.py", str(tmp_path / "a"),
                    str(tmp_path / "b"), str(tmp_path / "c"), "--out", str(out), "--png",
                    str(tmp_path / "m.png")], check=True, capture_output=True)
    res = json.loads(out.read_text())
    assert res["step_ratios"] == [{"run": "a", "b_dense": 2048, "workload": "512/512",
                                   "overlap_over_non_overlap": 1.25}]
    assert res["partial"] == ["nanojax bench step b"] and len(res["step"]) == 3
    assert res["peer_separate_call"]["total_tokens_per_s"] == 1000.0
    assert [(r["ours"], r["peer_from"], r["ratio"]) for r in res["ours_over_peer_across_calls"]
            ] == [("c/engine_warm.json", "c/engine_peer.json", 10.0)]
    assert (tmp_path / "m.png").stat().st_size > 10_000


def test_held_step_plot_draws_the_held_results_and_refuses_a_file_without_them(tmp_path):
    """bench/repro/step/plot_held_step.py: one bar per held (workload, mode), labelled with
    its power and clock; a step file without --sustain-seconds is named as such."""
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location("plot_held_step",
                                                  "bench/repro/step/plot_held_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    held = {"step_s": 0.06, "fraction_of_optimal": 0.74,
            "power": {"samples": 40, "power_w_mean": 691.0, "sm_clock_mhz_mean": 1565.0}}
    rec = {"model": "m", "num_layers": 2, "results": [
        {"b_dense": 64, "workload": w, "mode": m, "sustained": held}
        for w in ("a", "b") for m in ("x", "y")] + [
        {"b_dense": 64, "workload": "c", "mode": "x"}]}  # not held: left out
    rows = mod.held_rows(rec)
    assert [(r["workload"], r["mode"]) for r in rows] == [("a", "x"), ("a", "y"), ("b", "x"),
                                                          ("b", "y")]
    assert rows[0]["ms"] == pytest.approx(60.0) and rows[0]["watts"] == 691.0
    path = tmp_path / "s.json"
    path.write_text(json.dumps(rec))
    assert mod.main([str(path), "--out", str(tmp_path / "h.png")]) == 0
    assert (tmp_path / "h.png").stat().st_size > 1000
    path.write_text(json.dumps({"results": [rec["results"][-1]]}))
    assert mod.main([str(path), "--out", str(tmp_path / "n.png")]) == 2
