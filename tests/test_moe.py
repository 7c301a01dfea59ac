"""Mixture of experts: the block against a plain per-token reference, its TP layout, tiny
Mixtral and Qwen2-MoE models against transformers (logits, and greedy tokens through
LLM.generate with several prompts at once), the executor's modes, loading and errors."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanojax.config import ModelConfig, named_shape
from nanojax.errors import UnsupportedError
from nanojax.models import init_params
from nanojax.models.bundle import ModelBundle
from nanojax.models.moe import MoEBlock, tp_slice

LOGIT_ATOL = 2e-3  # the dense models' bound (test_model_vs_transformers.py)


def _moe_cfg(shared: int = 48, renormalise: bool = False, **kw) -> ModelConfig:
    return named_shape("tiny").replace(num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=renormalise,
                                       shared_expert_intermediate_size=shared, **kw)


def _block_reference(p: dict, cfg: ModelConfig, h: np.ndarray) -> np.ndarray:
    """Token by token, expert by expert, in float64: what the block must compute."""
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    out = np.zeros_like(h, dtype=np.float64)
    for t, x in enumerate(h.astype(np.float64)):
        logits = x @ p["router"]["kernel"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:cfg.num_experts_per_tok]
        w = probs[top] / (probs[top].sum() if cfg.norm_topk_prob else 1.0)
        for e, we in zip(top, w):
            a = silu(x @ p["gate_proj"][e]) * (x @ p["up_proj"][e])
            out[t] += we * (a @ p["down_proj"][e])
        if cfg.shared_expert_intermediate_size:
            a = silu(x @ p["shared_gate_proj"]["kernel"]) * (x @ p["shared_up_proj"]["kernel"])
            gate = 1 / (1 + np.exp(-(x @ p["shared_expert_gate"]["kernel"])))
            out[t] += gate * (a @ p["shared_down_proj"]["kernel"])
    return out


@pytest.mark.parametrize("shared,renormalise", [(0, True), (48, False)])
def test_block_matches_a_per_token_reference(shared, renormalise):
    cfg = _moe_cfg(shared, renormalise)
    block = MoEBlock(cfg)
    h = jax.random.normal(jax.random.PRNGKey(1), (37, cfg.hidden_size), jnp.float32)
    params = block.init(jax.random.PRNGKey(2), h)
    # a sharper router than the init's, so each token's choice is clear
    params["params"]["router"]["kernel"] = params["params"]["router"]["kernel"] * 30
    got = np.asarray(jax.jit(block.apply)(params, h))
    want = _block_reference(params["params"], cfg, np.asarray(h))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_expert_weights_shard_for_tensor_parallelism_like_the_dense_ffn():
    """gate/up split by columns and down by rows: the ranks' outputs sum to the block's."""
    cfg = _moe_cfg(48)
    h = jax.random.normal(jax.random.PRNGKey(3), (19, cfg.hidden_size), jnp.float32)
    params = MoEBlock(cfg).init(jax.random.PRNGKey(4), h)
    full = MoEBlock(cfg).apply(params, h)
    tp = 2
    half = cfg.replace(moe_intermediate_size=cfg.moe_intermediate_size // tp,
                       shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp)
    parts = [MoEBlock(half).apply({"params": tp_slice(params["params"], r, tp)}, h)
             for r in range(tp)]
    assert parts[0].shape == full.shape
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(full), atol=2e-6)


# ---- tiny transformers models --------------------------------------------------------
HF_MOE = {
    "mixtral": dict(num_local_experts=4, intermediate_size=96),
    "qwen2_moe": dict(num_experts=4, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=4, intermediate_size=96, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
}


@pytest.fixture(scope="module", params=list(HF_MOE))
def hf_moe(request, tmp_path_factory):
    """(transformers model, its save_pretrained directory): 2 layers, 4 experts, top 2."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kind = request.param
    cls = {"mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[kind]
    torch.manual_seed(0)
    model = cls[1](cls[0](vocab_size=300, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                          max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
                          eos_token_id=None, bos_token_id=None, pad_token_id=0,
                          **HF_MOE[kind])).eval()
    with torch.no_grad():  # non-trivial norms and biases; decisive routers
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight") or name.endswith("moe.gate.weight"):
                p.mul_(5.0)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def test_tiny_moe_logits_match_transformers(hf_moe):
    import torch

    from checkpoints.hf_import import load_hf_dir
    from nanojax.reference import ReferenceGenerator
    hf, path = hf_moe
    bundle = load_hf_dir(path, dtype="float32", progress=False)
    assert bundle.config.is_moe and bundle.config.num_experts == 4
    ids = list(np.random.default_rng(0).integers(0, 300, size=48))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    ours = ReferenceGenerator(bundle.config, bundle.params, max_len=64).logits(ids)
    assert np.abs(theirs).max() > 1.0  # logits large enough for the bound to mean something
    err = np.abs(ours - theirs).max()
    assert err < LOGIT_ATOL, f"max |logit diff| {err}"
    # the test can fail: the other routing rule is far outside the bound
    other = bundle.config.replace(norm_topk_prob=not bundle.config.norm_topk_prob)
    wrong = ReferenceGenerator(other, bundle.params, max_len=64).logits(ids)
    assert np.abs(wrong - theirs).max() > 10 * LOGIT_ATOL


def test_tiny_moe_greedy_tokens_match_transformers_with_continuous_batching(hf_moe):
    import torch

    from nanojax.engine.llm import LLM
    from nanojax.engine.sampling import SamplingParams
    hf, path = hf_moe
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in (5, 23, 11, 40)]
    n_new = 10
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    # b_dense 32 < the prompts' 79 tokens: chunked prefill beside decodes, four at once
    llm = LLM(model=str(path), dtype="float32", b_dense=32, num_pages=64, max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert len({tuple(w) for w in want}) > 1  # not a degenerate model


def test_all_pipeline_modes_give_the_reference_tokens_on_an_moe_model():
    """The MoE block is the `mlp` nano-op: router and expert GEMMs on each nano-batch."""
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.sampling import SamplingParams
    from nanojax.pipeline.executor import PipelineForward
    from nanojax.pipeline.plan import MODES, validate
    from nanojax.reference import ReferenceGenerator

    cfg = _moe_cfg(48, num_layers=1)  # one layer: three modes' compiles stay short
    params = init_params(cfg, seed=5)
    params["params"] = dict(params["params"])
    for i in range(cfg.num_layers):  # decisive routers (the init's are near uniform)
        moe = params["params"][f"layers_{i}"]["moe"]
        moe["router"]["kernel"] = moe["router"]["kernel"] * 30
    bundle = ModelBundle(cfg, params, None)
    b = 32
    plan = validate({
        "version": 1, "model": cfg.signature(), "tp": 1, "b_dense": b,
        "nano_batches": {"qkv": [[0, 12], [12, b]], "attention": [[0, 20], [20, b]],
                         "o_proj": [[0, 20], [20, b]], "mlp": [[0, 8], [8, 24], [24, b]]},
        "nano_ops": [{"op": "qkv", "batch": 0}, {"op": "qkv", "batch": 1},
                     {"op": "attention", "batch": 0, "stream": 1, "share": 0.5},
                     {"op": "o_proj", "batch": 0}, {"op": "mlp", "batch": 0},
                     {"op": "attention", "batch": 1, "stream": 1, "share": 0.5},
                     {"op": "o_proj", "batch": 1}, {"op": "mlp", "batch": 1, "stream": 2},
                     {"op": "mlp", "batch": 2}]})
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, cfg.vocab_size, size=int(n)).tolist() for n in (5, 40, 9)]
    ref = ReferenceGenerator(cfg, params, max_len=128)
    want = [ref.generate(p, 5, ignore_eos=True) for p in prompts]
    for mode in MODES:
        fwd = PipelineForward(cfg, plan, mode)
        # which expert GEMMs each built layer asks for: mlp[1] on stream 2 (overlap
        # mode) takes ragged_dot, as no Mosaic GPU kernel may sit on a side stream
        asked, build = set(), fwd.layer
        fwd.layer = lambda mm=None, grouped_gemm=None: (
            asked.add(grouped_gemm), build(mm, grouped_gemm))[1]
        eng = LLMEngine(bundle, EngineConfig(b_dense=b, num_pages=32, max_model_len=128,
                                             constant_batch=True, step_cache=False),
                        forward=fwd)  # traced here: a cached step would build no layer
        ids = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        assert [done[i].token_ids for i in ids] == want, mode
        assert asked == ({None, "xla"} if mode == "overlap" else {None}), (mode, asked)


def test_moe_plan_signature_names_the_experts():
    from nanojax.pipeline.plan import PlanError, check_model
    cfg = named_shape("mixtral-8x7b")
    sig = cfg.signature()
    assert sig["num_experts"] == 8 and sig["num_experts_per_tok"] == 2
    dense = named_shape("llama3-8b").signature()
    assert "num_experts" not in dense  # shipped dense plans still match
    plan = {"model": {**sig, "num_experts": 16}, "tp": 1}
    with pytest.raises(PlanError, match="num_experts: plan 16 vs model 8"):
        check_model(plan, cfg)


# ---- shapes, loading, errors -------------------------------------------------------------
@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.70, 12.88),
                                               ("qwen2-57b-a14b", 57.41, 14.25),
                                               ("qwen3-30b-a3b", 30.53, 3.35),
                                               ("deepseek-67b", 67.43, 67.43)])
def test_named_shapes_total_and_active_parameters(name, total, active):
    from nanojax.models import param_shapes
    cfg = named_shape(name)
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(param_shapes(cfg)))
    assert n == cfg.param_count()
    assert abs(n / 1e9 - total) < 0.01
    assert abs(cfg.active_param_count() / 1e9 - active) < 0.01


def test_moe_orbax_round_trip(tmp_path):
    from checkpoints.orbax_store import load_orbax, save_orbax
    cfg = _moe_cfg(48)
    bundle = ModelBundle(cfg, jax.tree_util.tree_map(np.asarray, init_params(cfg)), None)
    loaded = load_orbax(save_orbax(bundle, tmp_path / "ck"))
    assert loaded.config == cfg
    flat = jax.tree_util.tree_flatten_with_path(bundle.params)[0]
    got = dict(jax.tree_util.tree_flatten_with_path(loaded.params)[0])
    assert len(flat) == len(got)
    for path, x in flat:
        np.testing.assert_array_equal(got[path], x)


def test_unsupported_architectures_are_named(tmp_path):
    from checkpoints.hf_import import load_hf_dir
    hf = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
          "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(UnsupportedError, match="deepseek_v2.*DeepseekV2ForCausalLM"):
        ModelConfig.from_hf(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedError, match="deepseek_v2"):
        load_hf_dir(tmp_path)
    mixed = {"model_type": "qwen2_moe", "vocab_size": 10, "hidden_size": 8,
             "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
             "mlp_only_layers": [1]}
    with pytest.raises(UnsupportedError, match="mlp_only_layers"):
        ModelConfig.from_hf(mixed)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_gguf_mixtral_imports_and_runs_like_its_source(quant, tmp_path):
    """A Mixtral GGUF as llama.cpp writes it (arch llama, expert_count, q/k permuted,
    ffn_*_exps [E, out, in]) loads back to the same weights and the same logits."""
    from checkpoints.gguf_import import load_gguf
    from nanojax.reference import ReferenceGenerator
    from tests.gguf_fixtures import write_llama_gguf
    cfg = _moe_cfg(0, True, architecture="mixtral", vocab_size=320, intermediate_size=32)
    params = jax.tree_util.tree_map(np.asarray, init_params(cfg, seed=7))
    write_llama_gguf(tmp_path / "mixtral.gguf", cfg, params, quant)
    bundle = load_gguf(tmp_path / "mixtral.gguf", dtype="float32", progress=False)
    assert bundle.config.replace(eos_token_ids=(), bos_token_id=None,
                                 rms_norm_eps=cfg.rms_norm_eps) == cfg  # eps stored as f32
    got = dict(jax.tree_util.tree_flatten_with_path(bundle.params)[0])
    tol = 0.0 if quant == "F32" else 1e-2
    for p, want in jax.tree_util.tree_flatten_with_path(params)[0]:
        err = np.abs(got[p] - want).max() / (np.abs(want).max() + 1e-12)
        assert err <= tol + 1e-7, (jax.tree_util.keystr(p), err)
    if quant == "F32":
        ids = list(range(5, 40))
        ours = ReferenceGenerator(bundle.config, bundle.params, max_len=64).logits(ids)
        want = ReferenceGenerator(bundle.config, params, max_len=64).logits(ids)
        np.testing.assert_array_equal(ours, want)


def test_gguf_moe_of_another_architecture_is_refused_by_name(tmp_path, monkeypatch):
    import gguf

    from checkpoints.gguf_import import load_gguf
    from tests.gguf_fixtures import write_llama_gguf
    cfg = named_shape("tiny")
    params = jax.tree_util.tree_map(np.asarray, init_params(cfg))
    real = gguf.GGUFWriter.add_block_count

    def qwen2_with_experts(self, n):
        real(self, n)
        self.add_expert_count(8)
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", qwen2_with_experts)
    write_llama_gguf(tmp_path / "moe.gguf", cfg, params)
    # the file says llama; relabel it qwen2 the way the writer stores the architecture
    data = (tmp_path / "moe.gguf").read_bytes().replace(b"llama", b"qwen2")
    (tmp_path / "q.gguf").write_bytes(data)
    with pytest.raises(UnsupportedError, match="'qwen2' with 8 experts"):
        load_gguf(tmp_path / "q.gguf", progress=False)


def test_peer_builds_a_mixtral_of_the_shape_and_serves_it():
    """The H200 comparison's peer: transformers' MixtralForCausalLM of the named shape
    (every parameter accounted for) through generate_batch."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from nanojax.bench.peer import hf_model_config, run_peer
    for shape in ("mixtral-8x7b", "qwen2-57b-a14b"):
        cls, hf_cfg = hf_model_config(named_shape(shape))
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(hf_cfg).parameters())
        assert n == named_shape(shape).param_count(), shape
    r = run_peer("tiny-moe", num_prompts=3, input_len=12, output_len=4, trace=None,
                 max_model_len=64)
    assert r["requests"] == 3 and r["output_tokens"] == 12
