"""FP8 (W8A8) for MoE models (issue 42): the stacked expert weights quantized per (expert,
output channel), the expert GEMMs on FP8 operands (XLA's ragged dot on the CPU; the Mosaic
GPU kernel is tests/test_grouped_matmul_mgpu.py's), the block against the same function
dequantized in float64, a tiny model's logits against the float model's, the engine's
greedy tokens on `random:tiny-moe` quantized, `nanojax info`, the tree's TP layout and the
FP8 MoE checkpoints (expert by expert, per channel or block-wise) and the refusal of
static activation scales."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.loader import load_model, quantize_bundle
from nanojax.config import named_shape
from nanojax.errors import UnsupportedError
from nanojax.layers.fp8 import (FP8, FP8_MAX, fp8_grouped_matmul, quantize_activation,
                                quantize_experts, quantize_params, quantize_weight,
                                reference_grouped_matmul)
from nanojax.models import init_params, param_shapes
from nanojax.models.moe import MoEBlock, expert_matmul_fp8, tp_slice


def _cfg(shared: int = 48, renormalise: bool = False, **kw):
    """4 experts, top 2, hidden 64, expert width 32 (with a Qwen2-MoE shared expert)."""
    shape = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=renormalise, shared_expert_intermediate_size=shared)
    return named_shape("tiny", "float32").replace(**{**shape, **kw})


def _block_params(cfg, seed=2, tokens=37):
    """A float MoE block's parameters (decisive router) and its input h [tokens, hidden]."""
    h = jax.random.normal(jax.random.PRNGKey(seed - 1), (tokens, cfg.hidden_size), jnp.float32)
    params = MoEBlock(cfg).init(jax.random.PRNGKey(seed), h)["params"]
    params["router"]["kernel"] = params["router"]["kernel"] * 30
    return params, h


# ---- quantizing the expert stacks ------------------------------------------------------
def test_expert_stacks_quantize_per_expert_and_output_channel():
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, 64, 24))) * 0.02  # [E, in, out]
    w[1] *= 50.0  # experts of different magnitudes: one scale per expert and channel
    w[2, :, 5] = 0.0  # an all-zero channel
    q = quantize_experts(w)
    w8, scale = q["weight"], q["weight_scale"]
    assert w8.dtype == FP8 and w8.shape == (3, 24, 64) and scale.shape == (3, 24)
    amax = np.abs(np.asarray(w8, np.float32)).max(axis=2)
    np.testing.assert_allclose(np.delete(amax.ravel(), 2 * 24 + 5), FP8_MAX)
    assert amax[2, 5] == 0.0 and np.isfinite(np.asarray(scale)).all()
    for e in range(3):  # each expert exactly as a dense projection of its own
        w8e, se = quantize_weight(w[e])
        np.testing.assert_array_equal(np.asarray(w8[e], np.float32), np.asarray(w8e, np.float32))
        np.testing.assert_array_equal(np.asarray(scale[e]), np.asarray(se))
    back = np.asarray(w8, np.float32) * np.asarray(scale)[..., None]
    np.testing.assert_allclose(np.swapaxes(back, 1, 2), w, atol=np.abs(w).max() / 16)


def test_quantized_tree_is_the_fp8_models_tree():
    """quantize_params on a float MoE model gives exactly the tree an fp8 config declares:
    experts, attention and the shared expert's SwiGLU in FP8; router, shared expert gate,
    embeddings and LM head in the model dtype."""
    cfg = _cfg(48, num_layers=1)
    q = quantize_params(init_params(cfg))
    want = param_shapes(cfg.replace(quantization="fp8"))
    got_meta = jax.tree_util.tree_map(lambda a: (a.shape, jnp.dtype(a.dtype)), q)
    want_meta = jax.tree_util.tree_map(lambda a: (a.shape, jnp.dtype(a.dtype)), want)
    assert got_meta == want_meta
    moe = q["params"]["layers_0"]["moe"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert moe[name]["weight"].dtype == FP8
    for name in ("shared_gate_proj", "shared_up_proj", "shared_down_proj"):
        assert moe[name]["weight"].dtype == FP8 and "kernel" not in moe[name]
    assert moe["router"]["kernel"].dtype == jnp.float32
    assert moe["shared_expert_gate"]["kernel"].dtype == jnp.float32
    assert q["params"]["layers_0"]["q_proj"]["weight"].dtype == FP8
    assert q["params"]["lm_head"]["kernel"].dtype == jnp.float32


# ---- the expert GEMM and the block -------------------------------------------------------
def test_fp8_expert_gemm_is_its_dequantized_f32_function():
    sizes = jnp.asarray([5, 0, 17, 10], jnp.int32)  # an empty expert among them
    x = jax.random.normal(jax.random.PRNGKey(3), (32, 64)) * jnp.arange(1, 33)[:, None]
    x8, sx = quantize_activation(x)
    w = quantize_experts(jax.random.normal(jax.random.PRNGKey(4), (4, 64, 48)) * 0.02)
    rows = jnp.repeat(jnp.arange(4), sizes, total_repeat_length=32)
    got = np.asarray(expert_matmul_fp8(x8, sx, w, sizes, rows, jnp.float32, kernel="xla"))
    ref = np.asarray(reference_grouped_matmul(x8, sx, w["weight"], w["weight_scale"], sizes))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-6
    # "auto" on the CPU: the same XLA path (the Mosaic GPU kernel needs a Hopper GPU)
    auto = expert_matmul_fp8(x8, sx, w, sizes, rows, jnp.float32)
    np.testing.assert_array_equal(np.asarray(auto), got)
    unscaled = np.asarray(fp8_grouped_matmul(x8, w["weight"], sizes))
    assert unscaled.shape == (32, 48) and np.abs(unscaled).max() > 448  # scales not applied


def _fp8_block_reference(p: dict, cfg, h: np.ndarray) -> np.ndarray:
    """The FP8 block token by token, expert by expert, in float64: the same quantized
    operands (activations per token, weights as stored) dequantized."""
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731

    def deq(node):  # an FP8 node -> float64 [in, out]
        w = np.asarray(node["weight"], np.float64) * np.asarray(node["weight_scale"])[..., None]
        return np.swapaxes(w, -1, -2)

    def q(x):  # a row quantized per token, dequantized
        x8, s = quantize_activation(jnp.asarray(x, jnp.float32)[None])
        return np.asarray(x8, np.float64)[0] * float(np.asarray(s).ravel()[0])
    gate, up, down = (deq(p[n]) for n in ("gate_proj", "up_proj", "down_proj"))
    out = np.zeros(h.shape, np.float64)
    for t, x in enumerate(h.astype(np.float64)):
        logits = x @ np.asarray(p["router"]["kernel"], np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:cfg.num_experts_per_tok]
        wts = probs[top] / (probs[top].sum() if cfg.norm_topk_prob else 1.0)
        xq = q(x)
        for e, we in zip(top, wts):
            out[t] += we * (q(silu(xq @ gate[e]) * (xq @ up[e])) @ down[e])
        if cfg.shared_expert_intermediate_size:
            a = silu(xq @ deq(p["shared_gate_proj"])) * (xq @ deq(p["shared_up_proj"]))
            g = 1 / (1 + np.exp(-(x @ np.asarray(p["shared_expert_gate"]["kernel"]))))
            out[t] += g * (q(a) @ deq(p["shared_down_proj"]))
    return out


@pytest.mark.parametrize("shared,renormalise", [(0, True), (48, False)])
def test_fp8_block_is_its_dequantized_function_and_close_to_the_float_block(shared,
                                                                             renormalise):
    cfg = _cfg(shared, renormalise)
    params, h = _block_params(cfg)
    fp8 = quantize_params(params)
    got = np.asarray(jax.jit(MoEBlock(cfg.replace(quantization="fp8")).apply)(
        {"params": fp8}, h), np.float64)
    want = _fp8_block_reference(fp8, cfg, np.asarray(h))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    exact = np.asarray(MoEBlock(cfg).apply({"params": params}, h), np.float64)
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 1e-3 < err < 0.08  # e4m3 operands: a few percent, not more, and not zero


def test_fp8_mixtral_block_lowers_for_cuda_with_the_mosaic_expert_gemms(monkeypatch):
    """A Mixtral-8x7B MoE block in FP8 at B_dense 2048 (4,096 expert rows), exported for
    CUDA on the CPU as if on a Hopper GPU: every expert GEMM is the Mosaic GPU FP8 kernel
    (gate and up share one lowering, down another), none XLA's ragged dot; with
    grouped_gemm "xla" all are."""
    import pallas_kernels.mosaic_gpu_support as support
    monkeypatch.setattr(support, "on_hopper", lambda: True)
    cfg = named_shape("mixtral-8x7b").replace(quantization="fp8")
    h = jax.ShapeDtypeStruct((2048, cfg.hidden_size), jnp.bfloat16)
    params = jax.eval_shape(MoEBlock(cfg).init, jax.random.PRNGKey(0), h)

    def lowered(kernel):
        f = jax.jit(MoEBlock(cfg, grouped_gemm=kernel).apply)
        return jax.export.export(f, platforms=["cuda"])(params, h).mlir_module()
    auto, xla = lowered("auto"), lowered("xla")
    assert auto.count("stablehlo.custom_call @mosaic_gpu") >= 2
    assert "chlo.ragged_dot" not in auto
    assert "mosaic_gpu" not in xla and "chlo.ragged_dot" in xla


@pytest.mark.gpu
def test_fp8_block_on_hopper_runs_the_mosaic_kernel_as_the_xla_path_does():
    """bf16, 128 tokens x top 2 = 256 rows, hidden and expert width 256: shapes the FP8
    grouped GEMM takes, so "auto" runs it (scales in its epilogue) where "xla" runs
    ragged_dot then the scales. The two differ by FP8 rounding, not bf16's: an ulp of
    difference in the first GEMM flips some of SiLU x up's e4m3 roundings (on an H100,
    each path 5.8-6.3% from the float block, 2.4% apart, XLA's own path jitted vs eager
    3.2%). A row sent to the wrong expert or a tile written twice is far outside that."""
    from pallas_kernels.mosaic_gpu_support import on_hopper
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    cfg = _cfg(0, True, dtype="bfloat16", hidden_size=256, moe_intermediate_size=256)
    params, h = _block_params(cfg, tokens=128)
    fp8, qcfg = quantize_params(params), cfg.replace(quantization="fp8")
    auto = jax.jit(MoEBlock(qcfg).apply)
    assert "mosaic_gpu" in auto.lower({"params": fp8}, h).as_text()
    got = np.asarray(auto({"params": fp8}, h), np.float64)
    want = np.asarray(jax.jit(MoEBlock(qcfg, grouped_gemm="xla").apply)({"params": fp8}, h),
                      np.float64)
    exact = np.asarray(MoEBlock(cfg, grouped_gemm="xla").apply({"params": params}, h))
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    assert rel(got, exact) < 1.3 * rel(want, exact)   # measured 0.063 vs 0.058
    assert rel(got, want) < 0.6 * rel(want, exact)    # measured 0.024
    per_row = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert per_row.max() < 0.15                        # measured 0.033


def test_fp8_expert_stacks_shard_like_the_float_ones():
    """tp_slice cuts FP8 expert weights on their own axes ([E, out, in]: gate/up by out,
    down by in; down's scales whole): the ranks' outputs sum to the block's, up to each
    rank quantizing its own slice of SiLU x up per token (well inside the FP8 block's own
    distance from the float block)."""
    cfg = _cfg(48)
    params, h = _block_params(cfg, seed=5, tokens=19)
    fp8, qcfg = quantize_params(params), cfg.replace(quantization="fp8")
    full = np.asarray(MoEBlock(qcfg).apply({"params": fp8}, h))
    exact = np.asarray(MoEBlock(cfg).apply({"params": params}, h))
    tp = 2
    half = qcfg.replace(moe_intermediate_size=cfg.moe_intermediate_size // tp,
                        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp)
    parts = sum(np.asarray(MoEBlock(half).apply({"params": tp_slice(fp8, r, tp)}, h))
                for r in range(tp))
    rel = lambda a: np.linalg.norm(a) / np.linalg.norm(exact)  # noqa: E731
    assert rel(parts - exact) < 1.2 * rel(full - exact)
    assert rel(parts - full) < 0.5 * rel(full - exact)
    from jax.sharding import PartitionSpec as P

    from nanojax.parallel.tp import TP_AXIS, param_spec
    spec = lambda *names, ndim: param_spec(  # noqa: E731
        [jax.tree_util.DictKey(n) for n in ("layers_0", "moe", *names)], ndim)
    assert spec("gate_proj", "weight", ndim=3) == P(None, TP_AXIS, None)
    assert spec("gate_proj", "weight_scale", ndim=2) == P(None, TP_AXIS)
    assert spec("down_proj", "weight", ndim=3) == P(None, None, TP_AXIS)
    assert spec("down_proj", "weight_scale", ndim=2) == P(None, None)


# ---- the model, the engine, the CLI --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_moe():
    return load_model("random:tiny-moe", dtype="float32")


def test_fp8_moe_model_is_made_as_quantized_at_load_and_close_to_the_float_one(tiny_moe):
    from nanojax.reference import ReferenceGenerator
    fp8 = quantize_bundle(tiny_moe, "fp8")
    assert fp8.config.quantization == "fp8" and fp8.config.is_moe
    # random:<moe shape> made quantized == the float model quantized after loading
    direct = load_model("random:tiny-moe", dtype="float32", quantization="fp8")
    flat = jax.tree_util.tree_flatten_with_path(fp8.params)[0]
    got = dict(jax.tree_util.tree_flatten_with_path(direct.params)[0])
    assert len(flat) == len(got)
    for path, x in flat:
        np.testing.assert_array_equal(np.asarray(got[path], np.float32), np.asarray(x, np.float32))
    ids = list(range(1, 40))
    ref = ReferenceGenerator(tiny_moe.config, tiny_moe.params, max_len=64).logits(ids)
    out = ReferenceGenerator(fp8.config, fp8.params, max_len=64).logits(ids)
    assert np.abs(out - ref).max() / ref.std() < 0.3
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= 0.85
    assert np.abs(out - ref).max() > 0  # the FP8 model does run quantized


def test_engine_generates_greedy_on_random_tiny_moe_in_fp8(tiny_moe):
    """LLM("random:tiny-moe", quantization="fp8"): the engine (paged cache, dense batch,
    chunked prefill beside decodes) gives the one-sequence reference's greedy tokens."""
    from nanojax.engine.llm import LLM
    from nanojax.engine.sampling import SamplingParams
    from nanojax.reference import ReferenceGenerator
    llm = LLM("random:tiny-moe", dtype="float32", quantization="fp8", b_dense=32,
              num_pages=64, max_model_len=128)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 41], list(range(100, 140))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    bundle = quantize_bundle(tiny_moe, "fp8")  # the same weights (test above)
    ref = ReferenceGenerator(bundle.config, bundle.params, max_len=128)
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref.generate(p, 8, ignore_eos=True)


def test_cli_info_shows_an_fp8_moe_shape(capsys):
    from nanojax.cli import main
    assert main(["info", "random:tiny-moe", "--quantization", "fp8"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quantization"] == "fp8" and info["config"]["num_experts"] == 4
    assert info["active_parameters"] < info["parameters"]


def test_fp8_moe_orbax_round_trip_keeps_fp8_experts(tiny_moe, tmp_path):
    from checkpoints.orbax_store import load_orbax, save_orbax
    fp8 = quantize_bundle(tiny_moe, "fp8")
    back = load_orbax(save_orbax(fp8, tmp_path / "ck"), dtype="bfloat16")
    assert back.config.quantization == "fp8" and back.config.is_moe
    q = back.params["params"]["layers_1"]["moe"]["down_proj"]
    assert q["weight"].dtype == FP8 and q["weight_scale"].dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(q["weight"], np.float32),
        np.asarray(fp8.params["params"]["layers_1"]["moe"]["down_proj"]["weight"], np.float32))
    assert back.params["params"]["layers_1"]["moe"]["router"]["kernel"].dtype == jnp.bfloat16


# ---- FP8 MoE checkpoints and what stays refused ---------------------------------------------
def test_static_activation_scales_are_refused_for_moe():
    with pytest.raises(UnsupportedError, match="per token"):
        named_shape("tiny-moe").replace(quantization="fp8", activation_scale="static")


def _tiny_hf_moe(kind, path):
    import torch
    import transformers
    cls, cfg_cls, extra = {
        "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                    dict(num_local_experts=4, intermediate_size=96)),
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                      dict(num_experts=4, intermediate_size=96, moe_intermediate_size=32,
                           norm_topk_prob=True, head_dim=32))}[kind]
    torch.manual_seed(0)
    model = cls(cfg_cls(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                        max_position_embeddings=256, initializer_range=0.1, **extra)).eval()
    with torch.no_grad():  # decisive routers
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "moe.gate.weight")):
                p.mul_(5.0)
    model.save_pretrained(path / "float", safe_serialization=True)
    return model


@pytest.mark.parametrize("kind, fmt", [("mixtral", "compressed-tensors"),
                                       ("qwen3_moe", "fp8-block")])
def test_fp8_moe_checkpoints_load_expert_by_expert(tmp_path, kind, fmt):
    """Mixtral in compressed-tensors (per channel; the router in the ignore list) and
    Qwen3-MoE in the block-wise 'fp8' format (Qwen3-30B-A3B-FP8's): each expert's FP8
    weight and scales stacked [E, out, in] / [E, out], the router float; per-channel
    experts are exactly what quantizing the float checkpoint at load gives; logits near
    the float model's."""
    pytest.importorskip("transformers")
    import torch
    from test_fp8_weights import _write_fp8_dir

    from checkpoints.hf_import import load_hf_dir
    from nanojax.reference import ReferenceGenerator
    model = _tiny_hf_moe(kind, tmp_path)
    bundle = load_hf_dir(_write_fp8_dir(tmp_path, fmt, model), dtype="float32",
                         progress=False)
    assert bundle.config.is_moe and bundle.config.quantization == "fp8"
    moe = bundle.params["params"]["layers_1"]["moe"]
    assert moe["down_proj"]["weight"].dtype == FP8 and moe["down_proj"]["weight"].shape == (
        4, 64, 32 if kind == "qwen3_moe" else 96)
    assert moe["down_proj"]["weight_scale"].shape == moe["down_proj"]["weight"].shape[:2]
    assert moe["router"]["kernel"].dtype == np.float32
    if fmt == "compressed-tensors":
        at_load = quantize_bundle(load_hf_dir(tmp_path / "float", dtype="float32",
                                              progress=False), "fp8")
        want = at_load.params["params"]["layers_1"]["moe"]["down_proj"]
        np.testing.assert_array_equal(np.asarray(moe["down_proj"]["weight"], np.float32),
                                      np.asarray(want["weight"], np.float32))
        np.testing.assert_allclose(moe["down_proj"]["weight_scale"], want["weight_scale"],
                                   rtol=1e-6)
    ids = list(np.random.default_rng(0).integers(0, 300, size=40))
    ours = ReferenceGenerator(bundle.config, bundle.params, max_len=64).logits(ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    # measured: mean |diff| 0.10-0.11 of the logits' std, top-1 0.83-0.88 (FP8 rounding
    # moves some near-tied routing); the scales dropped: 1.04-1.11 and 0.0
    assert np.abs(ours - theirs).mean() / theirs.std() < 0.2
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75


def test_an_fp8_router_is_refused_by_name_not_loaded_unscaled(tmp_path):
    """A router stored in e4m3 has no place in nanojax's tree (routers stay in the model
    dtype): a clear error, not routing on unscaled FP8 values."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file, save_file
    from test_fp8_weights import _write_fp8_dir

    from checkpoints.hf_import import load_hf_dir
    from nanojax.errors import CheckpointError
    src = _write_fp8_dir(tmp_path, "compressed-tensors", _tiny_hf_moe("mixtral", tmp_path))
    tensors = load_file(str(src / "model.safetensors"))
    router = "model.layers.0.block_sparse_moe.gate.weight"
    tensors[router] = tensors[router].to(torch.float8_e4m3fn)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{router} is stored in FP8"):
        load_hf_dir(src, progress=False)
