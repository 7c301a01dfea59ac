"""Plans (format, validation, ablations) and the nano-batch executor: every mode gives the
reference's tokens."""
import copy
import json

import numpy as np
import pytest

from nanojax.config import named_shape
from nanojax.engine.llm_engine import EngineConfig, LLMEngine
from nanojax.engine.sampling import SamplingParams
from nanojax.pipeline.executor import PipelineForward
from nanojax.pipeline.plan import MODES, PlanError, ablation, check_model, load_plan, validate


def _plan_for(cfg, b_dense):
    """Uneven, misaligned splits: attention and MLP cut the batch elsewhere than qkv."""
    return validate({
        "version": 1, "model": cfg.signature(), "tp": 1, "b_dense": b_dense,
        "nano_batches": {"qkv": [[0, 12], [12, b_dense]],
                         "attention": [[0, 20], [20, b_dense]],
                         "o_proj": [[0, 20], [20, b_dense]],
                         "mlp": [[0, 8], [8, 24], [24, b_dense]]},
        "nano_ops": [{"op": "qkv", "batch": 0, "stream": 0}, {"op": "qkv", "batch": 1},
                     {"op": "attention", "batch": 0, "stream": 1, "share": 0.5},
                     {"op": "o_proj", "batch": 0}, {"op": "mlp", "batch": 0},
                     {"op": "attention", "batch": 1, "stream": 1, "share": 0.5},
                     {"op": "o_proj", "batch": 1}, {"op": "mlp", "batch": 1},
                     {"op": "mlp", "batch": 2}]})


def test_shipped_plan_loads_and_matches_llama3_8b():
    plan = load_plan("llama3-8b-1gpu")
    check_model(plan, named_shape("llama3-8b"))
    with pytest.raises(PlanError, match="another model.*hidden_size: plan 4096 vs model 8192"):
        check_model(plan, named_shape("llama3-70b"))
    for mode in MODES:
        a = ablation(plan, mode)
        validate(a)
        if mode != "overlap":
            assert {op.get("stream", 0) for op in a["nano_ops"]} == {0}
    assert len(ablation(plan, "non-overlap")["nano_ops"]) == 4


@pytest.mark.parametrize("mutate,msg", [
    (lambda p: p.update(version=7), "version"),
    (lambda p: p["nano_batches"]["qkv"].__setitem__(1, [13, 32]), "tile"),
    (lambda p: p["nano_ops"].pop(), "unscheduled"),
    (lambda p: p["nano_ops"].append(dict(p["nano_ops"][0])), "twice"),
    (lambda p: p["nano_ops"][0].update(stream=9), "stream"),
])
def test_bad_plans_are_refused(mutate, msg, tmp_path):
    plan = copy.deepcopy(_plan_for(named_shape("tiny"), 32))
    mutate(plan)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(plan))
    with pytest.raises(PlanError, match=msg):
        load_plan(f)


def test_out_of_order_plan_is_refused():
    cfg = named_shape("tiny")
    plan = copy.deepcopy(_plan_for(cfg, 32))
    plan["nano_ops"].insert(0, plan["nano_ops"].pop(2))  # attention before its qkv
    with pytest.raises(PlanError, match="before its inputs"):
        PipelineForward(cfg, plan)


@pytest.mark.slow
def test_all_modes_give_the_reference_tokens(smollm2):
    from nanojax.reference import ReferenceGenerator
    plan = _plan_for(smollm2.config, 32)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 40000, size=int(n)).tolist() for n in (5, 40, 17, 9)]
    ref = ReferenceGenerator(smollm2.config, smollm2.params, max_len=128)
    want = [ref.generate(p, 8, ignore_eos=True) for p in prompts]
    for mode in MODES:
        eng = LLMEngine(smollm2, EngineConfig(b_dense=32, num_pages=32, max_model_len=128,
                                              constant_batch=True),
                        forward=PipelineForward(smollm2.config, plan, mode))
        ids = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        assert [done[i].token_ids for i in ids] == want, mode


def test_stream_regions_are_flattened_to_one_computation(smollm2):
    """XLA assigns streams only to flat regions: inline_calls must leave no nested call
    (jnp.einsum, jax.nn.silu, ... are jits) and compute the same values."""
    import jax
    import jax.numpy as jnp

    from nanojax.models.llama import DecoderLayer
    from nanojax.pipeline.streams import inline_calls

    cfg = smollm2.config
    layer, lp = DecoderLayer(cfg), {"params": smollm2.params["params"]["layers_0"]}
    x = jax.random.normal(jax.random.PRNGKey(0), (8, cfg.hidden_size), jnp.float32)

    def region(lp, x):
        return layer.apply(lp, x, method=DecoderLayer.mlp), jnp.floor_divide(x, 3.0)

    def nested(jaxpr):
        return [e.primitive.name for e in jaxpr.eqns
                if any(hasattr(v, "eqns") or hasattr(v, "jaxpr") for v in e.params.values())]

    assert nested(jax.make_jaxpr(region)(lp, x).jaxpr)  # the region does nest calls
    flat = inline_calls(region)
    assert nested(jax.make_jaxpr(flat)(lp, x).jaxpr) == []
    for got, want in zip(flat(lp, x), region(lp, x)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_scheduler_ends_prefill_chunks_at_the_attention_cuts():
    from nanojax.engine.kv_cache import PageAllocator
    from nanojax.engine.scheduler import Scheduler
    from nanojax.engine.sequence import Sequence

    sched = Scheduler(PageAllocator(256), page_size=4, b_dense=32, max_num_seqs=8,
                      max_model_len=128, chunk_cuts=(12, 20))
    for i in range(4):
        sched.add(Sequence(f"r{i}", list(range(1, 31)), SamplingParams(max_tokens=4)))
    sizes = []
    for _ in range(4):
        batch = sched.schedule()
        pos = 0
        for e in batch.entries:
            assert not any(pos < c < pos + e.num_tokens for c in (12, 20)), \
                f"chunk [{pos}, {pos + e.num_tokens}) straddles a cut"
            pos += e.num_tokens
        sizes.append(pos)
    # the cuts shorten chunks; while prompts are waiting the batch is still full
    assert sizes[:2] == [32, 32]


def test_scheduler_caps_the_sequences_prefilling_in_one_iteration():
    from nanojax.engine.kv_cache import PageAllocator
    from nanojax.engine.scheduler import Scheduler
    from nanojax.engine.sequence import Sequence

    sched = Scheduler(PageAllocator(256), page_size=4, b_dense=64, max_num_seqs=8,
                      max_model_len=128, max_prefill_seqs=2)
    for i in range(5):
        sched.add(Sequence(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=4)))
    first = sched.schedule()
    assert len(first.entries) == 2 and first.num_decodes == 0  # budget left: the cap binds
    second = sched.schedule()
    assert second.num_decodes == 2 and len(second.entries) == 4


def test_attention_nano_ops_in_any_order_give_the_reference_tokens(smollm2):
    """With chunks ending at the cuts, the decode nano-batch's attention may run after the
    prefill one's (the shipped 8B plan's order)."""
    from nanojax.reference import ReferenceGenerator
    plan = copy.deepcopy(_plan_for(smollm2.config, 32))
    ops = plan["nano_ops"]
    ops.insert(2, ops.pop(5))  # attention[1] now comes before attention[0]
    assert [(o["op"], o["batch"]) for o in ops[:4]] == [
        ("qkv", 0), ("qkv", 1), ("attention", 1), ("attention", 0)]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 40000, size=int(n)).tolist() for n in (30, 7, 45)]
    ref = ReferenceGenerator(smollm2.config, smollm2.params, max_len=128)
    want = [ref.generate(p, 6, ignore_eos=True) for p in prompts]
    eng = LLMEngine(smollm2, EngineConfig(b_dense=32, num_pages=32, max_model_len=128,
                                          constant_batch=True),
                    forward=PipelineForward(smollm2.config, plan, "overlap"))
    ids = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
           for p in prompts]
    done = eng.run_to_completion()
    assert [done[i].token_ids for i in ids] == want


def test_overlap_groups_pair_each_side_op_with_the_gemms_issued_beside_it():
    from nanojax.pipeline.executor import overlap_groups
    groups = overlap_groups(load_plan("llama3-8b-1gpu"))
    # prefill attention beside the decode nano-batch's qkv; decode attention beside the
    # prefill nano-batch's o_proj and MLP (all on stream 2); o_proj[0] needs attention[0]
    assert groups == {("attention", 1): 1, ("qkv", 0): 1,
                      ("attention", 0): 2, ("o_proj", 1): 2, ("mlp", 1): 2}
    # main-stream ops never join (XLA drops their annotation); a group ends where the
    # anchor's own stream is used again
    plan = load_plan("llama3-8b-1gpu")
    for op in plan["nano_ops"]:
        if op["op"] == "mlp" and op["batch"] == 1:
            op["stream"] = 0
        if op["op"] == "o_proj" and op["batch"] == 1:
            op["stream"] = 1
    assert overlap_groups(plan) == {("attention", 1): 1, ("qkv", 0): 1}


def test_scheduling_group_lands_on_the_stream_call():
    """XLA builds a side-stream op's async start/done from the call that compute_on lowers
    to: the scheduling group must be on that call, not only on its output markers."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.experimental.xla_metadata import set_xla_metadata

    import nanojax.pipeline.streams as streams
    assert streams.carry_metadata_to_stream_calls()
    import jax.experimental.compute_on as co
    from jax._src import core
    annotate = getattr(co, "compute_on2", None) or co.compute_on

    def f(x):
        with set_xla_metadata(_scheduling_group_id="7"):
            y = annotate(lambda y: y * 2, compute_type="gpu_stream:1",
                         out_memory_spaces=core.MemorySpace.Device)(x)
        return y + 1
    text = jax.jit(f).lower(jnp.zeros(4)).as_text()
    calls = [ln for ln in text.splitlines() if re.search(r"call @compute_on", ln)]
    assert calls and all('_scheduling_group_id = "7"' in ln for ln in calls)


@pytest.mark.gpu
def test_the_modes_compute_the_same_function_on_the_gpu(tmp_path):
    """On the GPU the modes' tokens need not match bit for bit: XLA picks a GEMM kernel per
    shape (M 256 vs 512) and per place (inside a side-stream region it calls cuBLAS where
    the main stream gets a Triton GEMM fusion), and bf16 rounding differs with the kernel
    (bench/results/mode_agreement/). What must hold: each mode is deterministic (a race
    would not repeat itself), no mode is farther from the float32 computation than
    non-overlap is, and the modes differ from each other by less than bf16 differs from
    float32. Through the CLI, in its own process: the stream flags must be set first."""
    import os
    import subprocess
    import sys
    out = tmp_path / "step.json"
    # this process already holds most of the GPU's memory: the child takes what it needs
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    subprocess.run([sys.executable, "-m", "nanojax", "bench", "step", "--model",
                    "random:llama3-8b", "--num-layers", "4", "--plan", "llama3-8b-1gpu",
                    "--b-dense", "512,2048", "--workloads", "splitwise,sharegpt", "--modes",
                    "non-overlap,nanobatch-only,overlap", "--repeats", "2", "--f32-reference",
                    "--num-pages", "8192", "--quiet", "--json", str(out)],
                   check=True, timeout=600, env=env)
    rows = json.loads(out.read_text())["results"]
    assert not [r for r in rows if "error" in r]
    base = {(r["b_dense"], r["workload"]): r["logits_max_diff_over_std_vs_f32"]
            for r in rows if r["mode"] == "non-overlap"}
    bad = [(r["mode"], r["b_dense"], r["workload"], r["repeat_same_tokens"],
            r["logits_max_diff_over_std"], r["logits_max_diff_over_std_vs_f32"],
            base[r["b_dense"], r["workload"]]) for r in rows
           if r["repeat_same_tokens"] < 1.0 or r["repeat_logits_max_abs_diff"] > 0
           or r["logits_max_diff_over_std_vs_f32"] > 1.25 * base[r["b_dense"], r["workload"]]
           or r["logits_max_diff_over_std"] > base[r["b_dense"], r["workload"]]]
    assert not bad, bad


def test_side_streams_take_no_mosaic_kernel_unless_one_is_named():
    from nanojax.config import KernelConfig
    from nanojax.pipeline.executor import side_stream_kernels
    auto = KernelConfig()
    assert side_stream_kernels(auto) == auto.replace(decode_kernel="triton",
                                                     grouped_gemm="xla")
    named = KernelConfig(decode_kernel="mosaic", prefill_kernel=True)
    assert side_stream_kernels(named) == named.replace(grouped_gemm="xla")
    assert side_stream_kernels(named.replace(grouped_gemm="xla")) == named.replace(
        grouped_gemm="xla")


def _fused_plan(cfg, b_dense=32, **fused):
    """_plan_for with mlp[0] and attention[1] (adjacent, independent) as one fused launch."""
    plan = copy.deepcopy(_plan_for(cfg, b_dense))
    for op in plan["nano_ops"]:
        if (op["op"], op["batch"]) == ("attention", 1):
            op.update(stream=0, share=1.0)
        if (op["op"], op["batch"]) == ("mlp", 0):
            op["fused"] = {"attention": 1, "gemm_programs": 88, "programs": 132, **fused}
    return plan


def _op(plan, g, k):
    return next(op for op in plan["nano_ops"] if (op["op"], op["batch"]) == (g, k))


def test_a_fused_pair_validates_and_the_ablations_drop_it():
    from nanojax.pipeline.plan import fused_pairs
    plan = validate(_fused_plan(named_shape("tiny")))
    pair = {"gemm": ("mlp", 0), "attention": 1, "gemm_programs": 88, "programs": 132}
    assert fused_pairs(plan) == {("mlp", 0): pair, ("attention", 1): pair}
    assert fused_pairs(ablation(plan, "overlap")) == fused_pairs(plan)
    for mode in ("non-overlap", "nanobatch-only"):
        assert fused_pairs(validate(ablation(plan, mode))) == {}


@pytest.mark.parametrize("mutate,msg", [
    (lambda p: _op(p, "mlp", 0)["fused"].update(gemm_programs=0), "out of range"),
    (lambda p: _op(p, "mlp", 0)["fused"].update(gemm_programs=132), "out of range"),
    (lambda p: _op(p, "mlp", 0)["fused"].update(attention=2), "does not have"),
    (lambda p: _op(p, "mlp", 0)["fused"].update(layer=3), "fused must be"),
    (lambda p: _op(p, "mlp", 0)["fused"].update(programs="132"), "fused must be"),
    (lambda p: _op(p, "attention", 0).update(fused=_op(p, "mlp", 0).pop("fused")),
     "attention is not a GEMM"),
    (lambda p: _op(p, "attention", 1).update(stream=1), "stream 0"),
    # o_proj[0] is not next to attention[1]
    (lambda p: _op(p, "o_proj", 0).update(fused=_op(p, "mlp", 0).pop("fused")),
     "not adjacent"),
    # qkv[1] (tokens 12-32) is next to attention[0] (0-20), which reads it
    (lambda p: (_op(p, "attention", 0).update(stream=0),
                _op(p, "qkv", 1).update(fused=dict(_op(p, "mlp", 0).pop("fused"),
                                                   attention=0))),
     r"attention\[0\] reads qkv\[1\]"),
    # o_proj[1] (20-32) after attention[1] (20-32) reads it
    (lambda p: _op(p, "o_proj", 1).update(fused=_op(p, "mlp", 0).pop("fused")),
     r"o_proj\[1\] reads attention\[1\]"),
    # mlp[0] and o_proj[1] both name attention[1]
    (lambda p: _op(p, "o_proj", 1).update(fused=dict(_op(p, "mlp", 0)["fused"])),
     "fused with both"),
])
def test_bad_fused_pairs_are_refused(mutate, msg):
    plan = _fused_plan(named_shape("tiny"))
    mutate(plan)
    with pytest.raises(PlanError, match=msg):
        validate(plan)


def test_fused_pairs_give_the_non_overlap_tokens_in_every_mode(tiny_bundle):
    """On the CPU the pair cannot be one launch: it runs back to back, says why, and every
    mode gives the tokens of non-overlap."""
    plan = _fused_plan(tiny_bundle.config)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, tiny_bundle.config.vocab_size, size=int(n)).tolist()
               for n in (5, 23, 11)]
    tokens, reports = {}, {}
    for mode in MODES:
        fwd = PipelineForward(tiny_bundle.config, plan, mode)
        # the report is written when the step is traced: no executable from the step cache
        eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=32,
                                                  max_model_len=64, constant_batch=True,
                                                  step_cache=False),
                        forward=fwd)
        ids = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        tokens[mode] = [done[i].token_ids for i in ids]
        reports[mode] = fwd.fused_report
    assert tokens["overlap"] == tokens["nanobatch-only"] == tokens["non-overlap"]
    assert reports["non-overlap"] == reports["nanobatch-only"] == {}
    r = reports["overlap"]["mlp[0]+attention[1]"]
    assert r["launch"] == "back to back" and "no Hopper GPU" in r["reason"]


def test_why_a_fused_pair_runs_back_to_back():
    """Each reason fused.unavailable gives, pinned device facts (no GPU here)."""
    import jax.numpy as jnp

    from nanojax.config import KernelConfig
    from nanojax.layers.attention import paged_attention, pallas_backend
    from nanojax.pipeline.fused import unavailable
    pair = {"gemm_programs": 88, "programs": 132}
    q = jnp.zeros((4, 32, 128), jnp.bfloat16)
    kv = (jnp.zeros((8, 8, 16, 128), jnp.bfloat16),) * 2
    pallas = pallas_backend(KernelConfig(decode_kernel="mosaic"))
    assert "no Hopper" in unavailable(pallas, pair, q, kv, hopper=False)
    assert "not the Pallas one" in unavailable(paged_attention, pair, q, kv, hopper=True,
                                               sms=132)
    triton = pallas_backend(KernelConfig(decode_kernel="triton"))
    assert "decode kernel is triton" in unavailable(triton, pair, q, kv, hopper=True,
                                                    sms=132)
    fp8 = (kv[0].astype(jnp.float8_e4m3fn),) * 2  # FP8 pages: Triton unless swap-AB named,
    auto = pallas_backend(KernelConfig(decode_kernel="auto"))  # and never fused
    assert "decode kernel is triton" in unavailable(auto, pair, q, fp8, hopper=True, sms=132)
    assert "FP8 pages" in unavailable(pallas, pair, q, fp8, hopper=True, sms=132)
    assert "132 programs, the device 114 SMs" in unavailable(pallas, pair, q, kv,
                                                             hopper=True, sms=114)
    assert unavailable(pallas, pair, q, kv, hopper=True, sms=132) is None


def test_a_gemm_the_fused_kernel_cannot_tile_runs_alone_and_says_why():
    """PairMatmul leaves GEMMs the kernel cannot take to the plain dot (the executor then
    runs the attention after the GEMM nano-op); none is fused, and why names the shape."""
    import jax.numpy as jnp

    from nanojax.pipeline.fused import PairMatmul

    def never(decode):
        raise AssertionError("no fused launch expected")
    q = jnp.zeros((4, 32, 128), jnp.bfloat16)
    kv = (jnp.zeros((8, 8, 16, 128), jnp.bfloat16),) * 2
    mm = PairMatmul(never, q, kv, None, None, gemm_programs=88, programs=132)
    x = jnp.ones((100, 64), jnp.bfloat16)
    w = jnp.ones((64, 256), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(mm(x, w), np.float32),
                                  np.asarray(jnp.dot(x, w), np.float32))
    assert mm.attention_out is None and "M = 100" in mm.why


def test_a_fused_pair_step_lowers_for_cuda_as_one_launch():
    """The whole overlap step of a one-layer bf16 model whose shapes the fused kernel
    tiles (128-token nano-batches, D 128), exported for CUDA on the CPU with the device
    facts pinned to an H200's: mlp[0] and attention[1] go through the fused launch
    (fused_report), attention[0] through the swap-AB kernel alone."""
    import re

    import jax
    import jax.numpy as jnp

    from nanojax.config import KernelConfig, ModelConfig
    from nanojax.layers.attention import PagedMetadata, pallas_backend
    from nanojax.models.llama import init_params
    cfg = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=128, dtype="bfloat16")
    halves = [[0, 128], [128, 256]]
    plan = validate({
        "version": 1, "model": cfg.signature(), "tp": 1, "b_dense": 256,
        "nano_batches": {g: halves for g in ("qkv", "attention", "o_proj", "mlp")},
        "nano_ops": [{"op": "qkv", "batch": 0}, {"op": "qkv", "batch": 1},
                     {"op": "attention", "batch": 0}, {"op": "o_proj", "batch": 0},
                     {"op": "mlp", "batch": 0, "fused": {"attention": 1,
                                                         "gemm_programs": 88,
                                                         "programs": 132}},
                     {"op": "attention", "batch": 1}, {"op": "o_proj", "batch": 1},
                     {"op": "mlp", "batch": 1}]})
    fwd = PipelineForward(cfg, plan, "overlap",
                          attention=pallas_backend(KernelConfig(decode_kernel="mosaic")))
    fwd.fused_device = {"hopper": True, "sms": 132}
    sd = jax.ShapeDtypeStruct
    t, pages, width = 256, 1024, 8
    params = jax.tree_util.tree_map(lambda a: sd(a.shape, a.dtype),
                                    jax.eval_shape(lambda: init_params(cfg)))
    kv = [(sd((pages, 2, 16, 128), jnp.bfloat16),) * 2]
    i32 = sd((t,), jnp.int32)
    meta = PagedMetadata(i32, i32, i32, sd((t, width), jnp.int32), i32, sd((), jnp.int32))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # the append
    exported = jax.export.export(jax.jit(fwd.__call__), platforms=["cuda"],
                                 disabled_checks=[triton])(
        params, sd((t,), jnp.int32), kv, meta, sd((8,), jnp.int32))
    assert fwd.fused_report == {"mlp[0]+attention[1]": {
        "launch": "fused", "gemm_programs": 88, "programs": 132, "reason": ""}}
    calls = [ln for ln in exported.mlir_module().splitlines()
             if re.search(r"stablehlo.custom_call @mosaic_gpu", ln)]
    # attention[0]'s swap-AB kernel, and the pair: one launch that takes mlp[0]'s gate GEMM
    # (x [128, 512], w [512, 1024]) and returns its output beside the attention's
    assert len(calls) == 2
    fused_call = [ln for ln in calls if "-> (tensor<128x1024xbf16>, tensor<128x" in ln]
    assert len(fused_call) == 1
    assert "(tensor<128x512xbf16>, tensor<512x1024xbf16>, " in fused_call[0]
