"""FP8 weights and activations (W8A8, nanojax/layers/fp8.py): the projection against its
float32 reference, quantization at load (`--quantization fp8`), the FP8 checkpoint
formats vLLM loads (compressed-tensors, 'fp8'), the orbax round trip, tensor parallelism's
layout, and the engine's tokens against the plain reference on the quantized model."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.hf_import import load_hf_dir
from checkpoints.hf_quantization import fp8_scheme
from checkpoints.loader import load_model, quantize_bundle
from checkpoints.orbax_store import load_orbax, save_orbax
from nanojax.config import named_shape
from nanojax.errors import CheckpointError, UnsupportedError
from nanojax.layers.fp8 import (FP8, FP8_MAX, fp8_linear, quantize_activation,
                                quantize_weight, reference_linear)


def _rand(shape, seed, scale=1.0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) * scale


def test_weight_scales_map_each_channel_absmax_to_448():
    kernel = _rand((64, 24), 0, 0.02).at[:, 3].set(0.0)  # [in, out]; one all-zero channel
    w8, scale = quantize_weight(kernel)
    assert w8.dtype == FP8 and w8.shape == (24, 64) and scale.shape == (24,)
    amax = np.abs(np.asarray(w8, np.float32)).max(axis=1)
    np.testing.assert_allclose(np.delete(amax, 3), FP8_MAX)
    assert amax[3] == 0.0 and np.isfinite(np.asarray(scale)).all()
    back = np.asarray(w8, np.float32) * np.asarray(scale)[:, None]
    np.testing.assert_allclose(back.T, kernel, atol=0.02 * 4 / 16)  # e4m3: 3 mantissa bits


def test_activations_are_scaled_per_token_or_by_the_static_scale():
    x = _rand((5, 32), 1) * jnp.arange(1, 6)[:, None]  # rows of different magnitudes
    x8, sx = quantize_activation(x)
    assert sx.shape == (5, 1)
    np.testing.assert_allclose(np.abs(np.asarray(x8, np.float32)).max(axis=1), FP8_MAX)
    x8s, s = quantize_activation(x * 100, jnp.float32(0.01))  # saturates, never inf / NaN
    assert s.shape == () and np.abs(np.asarray(x8s, np.float32)).max() == FP8_MAX


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_linear_matches_its_float32_reference(dtype):
    x = _rand((16, 128), 2).astype(dtype)
    kernel = _rand((128, 48), 3, 0.02)
    w8, sw = quantize_weight(kernel)
    got = np.asarray(fp8_linear(x, w8, sw), np.float32)
    ref = np.asarray(reference_linear(x, w8, sw))
    tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: the output's own rounding
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol
    exact = np.asarray(x, np.float32) @ np.asarray(kernel)
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 5e-3 < err < 0.06  # e4m3 operands: a few percent, not more, and not zero


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_quantized_random_model_is_fp8_and_close_to_the_float_one(tiny_bundle, quant):
    fp8 = quantize_bundle(tiny_bundle, quant)
    assert fp8.config.quantization == quant and tiny_bundle.config.quantization is None
    layer = fp8.params["params"]["layers_0"]
    assert layer["q_proj"]["weight"].dtype == FP8 and "kernel" not in layer["q_proj"]
    assert fp8.params["params"]["lm_head"]["kernel"].dtype == np.float32  # stays float
    # made quantized (random:<shape> with quantization) == quantized after loading
    direct = load_model("random:tiny", dtype="float32", quantization=quant)
    for a, b in zip(jax.tree_util.tree_leaves(direct.params), jax.tree_util.tree_leaves(fp8.params)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    from nanojax.reference import ReferenceGenerator
    ids = list(range(1, 40))
    ref = ReferenceGenerator(tiny_bundle.config, tiny_bundle.params, max_len=64).logits(ids)
    got = ReferenceGenerator(fp8.config, fp8.params, max_len=64).logits(ids)
    assert np.abs(got - ref).max() / ref.std() < 0.3
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.85


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_engine_tokens_equal_the_reference_on_the_fp8_model(tiny_bundle, quant):
    """The engine (paged cache, dense batch, layer-wise CPU forward) runs the quantized
    model exactly as the one-sequence reference does: the same greedy tokens."""
    from nanojax.engine.llm import LLM
    from nanojax.engine.sampling import SamplingParams
    from nanojax.reference import ReferenceGenerator
    llm = LLM(tiny_bundle, quantization=quant, b_dense=32, max_model_len=128)
    bundle = quantize_bundle(tiny_bundle, quant)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 41], list(range(100, 140))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    ref = ReferenceGenerator(bundle.config, bundle.params, max_len=128)
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref.generate(p, 10, ignore_eos=True)


def test_fp8_block_scales_each_128_block(tiny_bundle):
    """fp8-block: one scale per 128 x 128 block of each weight (edge blocks partial: the
    tiny model's 64 / 160-wide projections), as quantize_weight_blocks makes them."""
    from nanojax.layers.fp8 import quantize_weight_blocks
    gate = quantize_bundle(tiny_bundle, "fp8-block").params["params"]["layers_0"]["gate_proj"]
    assert gate["weight"].shape == (160, 64) and gate["weight_scale"].shape == (2, 1)
    w8, scale = quantize_weight_blocks(tiny_bundle.params["params"]["layers_0"]["gate_proj"]
                                       ["kernel"])
    np.testing.assert_array_equal(np.asarray(gate["weight"], np.float32),
                                  np.asarray(w8, np.float32))
    np.testing.assert_array_equal(gate["weight_scale"], scale)
    kernel = np.zeros((300, 200), np.float32)  # [in, out]: blocks of 2 x 3 scales
    kernel[129, 5], kernel[3, 150] = 7.0, -0.5
    w8, scale = quantize_weight_blocks(kernel)
    assert scale.shape == (2, 3)
    np.testing.assert_allclose([scale[0, 1], scale[1, 0]], [7.0 / 448, 0.5 / 448], rtol=1e-6)
    assert float(w8[5, 129].astype(np.float32)) == 448.0
    assert float(w8[150, 3].astype(np.float32)) == -448.0


def test_fp8_block_is_refused_where_it_does_not_run(tiny_bundle):
    from nanojax.parallel.tp import TPLayout
    with pytest.raises(UnsupportedError, match="dense models"):
        named_shape("tiny-moe").replace(quantization="fp8-block")
    with pytest.raises(UnsupportedError, match="dense models"):
        named_shape("tiny").replace(quantization="fp8-block", activation_scale="static")
    with pytest.raises(UnsupportedError, match="tensor_parallel_size 1"):
        TPLayout(named_shape("tiny").replace(quantization="fp8-block"), 2)
    with pytest.raises(CheckpointError, match="cannot be re-quantized as fp8-block"):
        quantize_bundle(quantize_bundle(tiny_bundle, "fp8"), "fp8-block")


def test_requantizing_or_unsupported_quantization_is_refused(tiny_bundle):
    fp8 = quantize_bundle(tiny_bundle, "fp8")
    assert quantize_bundle(fp8, "fp8") is fp8  # an FP8 checkpoint asked for FP8: as it is
    with pytest.raises(UnsupportedError, match="MoE"):  # FP8 MoE: tests/test_fp8_moe.py
        named_shape("tiny-moe").replace(quantization="fp8", activation_scale="static")
    with pytest.raises(UnsupportedError, match="int4"):
        named_shape("tiny").replace(quantization="int4")
    with pytest.raises(UnsupportedError, match="int4"):
        quantize_bundle(tiny_bundle, "int4")


@pytest.mark.parametrize("quant", ["fp8", "fp8-block"])
def test_orbax_round_trip_keeps_fp8(tiny_bundle, tmp_path, quant):
    fp8 = quantize_bundle(tiny_bundle, quant)
    dst = save_orbax(fp8, tmp_path / "ck")
    back = load_orbax(dst, dtype="bfloat16")  # the model dtype changes, FP8 stays FP8
    assert back.config.quantization == quant and back.config.dtype == "bfloat16"
    q = back.params["params"]["layers_1"]["down_proj"]
    assert q["weight"].dtype == FP8 and q["weight_scale"].dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(q["weight"], np.float32),
        np.asarray(fp8.params["params"]["layers_1"]["down_proj"]["weight"], np.float32))
    assert back.params["params"]["embed"]["embedding"].dtype == jnp.bfloat16
    # a nanojax checkpoint holding a NaN scale is refused by name too
    bad = jax.tree_util.tree_map(np.array, fp8.params)
    bad["params"]["layers_0"]["o_proj"]["weight_scale"].reshape(-1)[0] = np.nan
    dst = save_orbax(dataclasses.replace(fp8, params=bad), tmp_path / "bad")
    with pytest.raises(CheckpointError, match=r"\['layers_0'\]\['o_proj'\]\['weight_scale'\]"):
        load_orbax(dst)


def test_fp8_values_on_devices_are_checked_where_they_lie(tiny_bundle, monkeypatch):
    """A tree on the devices (a tensor-parallel restore's shards) is checked by one
    program and one fetch of counts; only a leaf holding a bad value comes to the host,
    for the same message the host check gives (the flat index included)."""
    from checkpoints import bundle
    from checkpoints.bundle import check_fp8_values
    on_host = []
    host_check = bundle.check_fp8_tensor
    monkeypatch.setattr(bundle, "check_fp8_tensor",
                        lambda arr, *a: on_host.append(a[1]) or host_check(arr, *a))
    fp8 = quantize_bundle(tiny_bundle, "fp8")
    on_device = jax.tree_util.tree_map(jnp.asarray, fp8.params)
    check_fp8_values(fp8.config, on_device)  # a clean tree passes, none of it fetched
    assert on_host == []
    layer = on_device["params"]["layers_1"]

    def with_leaf(proj, leaf, value):
        node = {**layer[proj], leaf: value}
        return {"params": {**on_device["params"], "layers_1": {**layer, proj: node}}}
    bad_scale = layer["gate_proj"]["weight_scale"].at[3].set(-1.0)
    with pytest.raises(CheckpointError, match=r"\['layers_1'\]\['gate_proj'\]\['weight_scale'\]"
                                              r" holds 1 value.*flat index 3: -1\.0"):
        check_fp8_values(fp8.config, with_leaf("gate_proj", "weight_scale", bad_scale))
    codes = jax.lax.bitcast_convert_type(layer["v_proj"]["weight"], jnp.uint8)
    nan_weight = jax.lax.bitcast_convert_type(codes.at[0, 5].set(0xFF), FP8)
    with pytest.raises(CheckpointError, match=r"\['v_proj'\]\['weight'\] holds 1 NaN value.*"
                                              r"flat index 5\)"):
        check_fp8_values(fp8.config, with_leaf("v_proj", "weight", nan_weight))
    assert len(on_host) == 2 and all("layers_1" in name for name in on_host)


def test_tp_specs_split_fp8_weights_along_their_own_axes():
    from jax.sharding import PartitionSpec as P

    from nanojax.parallel.tp import TP_AXIS, TPLayout, param_spec
    key = jax.tree_util.DictKey
    spec = lambda *names, ndim=2: param_spec([key(n) for n in names], ndim)  # noqa: E731
    assert spec("layers_0", "q_proj", "weight") == P(TP_AXIS, None)     # [out, in]: out
    assert spec("layers_0", "q_proj", "weight_scale", ndim=1) == P(TP_AXIS)
    assert spec("layers_0", "o_proj", "weight") == P(None, TP_AXIS)     # row-parallel: in
    assert spec("layers_0", "o_proj", "weight_scale", ndim=1) == P(None)
    assert spec("layers_0", "q_proj", "input_scale", ndim=0) == P()
    assert spec("layers_0", "q_proj", "kernel") == P(None, TP_AXIS)     # float: [in, out]
    # KV heads repeated for TP 4 > 2 KV heads: an FP8 weight's rows, its scales alike
    cfg = named_shape("tiny", "float32").replace(quantization="fp8")
    from nanojax.models import init_params
    params = jax.tree_util.tree_map(np.asarray, init_params(cfg))
    out = TPLayout(cfg, 4).transform(params, np)["params"]["layers_0"]["k_proj"]
    w = params["params"]["layers_0"]["k_proj"]["weight"].astype(np.float32)  # [KVH * D, in]
    d = cfg.head_dim
    rep = out["weight"].astype(np.float32)
    assert rep.shape == (2 * w.shape[0], w.shape[1])
    np.testing.assert_array_equal(rep[:d], w[:d])
    np.testing.assert_array_equal(rep[d:2 * d], w[:d])      # head 0 twice, then head 1
    np.testing.assert_array_equal(rep[2 * d:3 * d], w[d:2 * d])
    assert out["weight_scale"].shape == (2 * w.shape[0],)


# ---- FP8 checkpoints as vLLM loads them ---------------------------------------------
# the projections an FP8 checkpoint quantizes (w1/w2/w3: Mixtral's experts); MoE routers
# (mlp.gate, block_sparse_moe.gate) and the shared expert's gate stay float
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "w1", "w2", "w3")


def _float_hf_dir(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "float", safe_serialization=True)
    return model


BLOCK = (48, 32)  # partial edge blocks on every projection of the 64 / 96-wide model


def _block_quantize(p, block):
    """torch [out, in] -> (e4m3 weight, f32 scale [ceil(out/r), ceil(in/c)]): each block's
    absmax to 448, as DeepSeek-V3 / Qwen3-FP8 / llm-compressor's FP8_BLOCK store them."""
    import torch
    r, c = block
    n, k = p.shape
    nb, kb = -(-n // r), -(-k // c)
    padded = torch.zeros(nb * r, kb * c)
    padded[:n, :k] = p
    scale = padded.reshape(nb, r, kb, c).abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(r, 0).repeat_interleave(c, 1)[:n, :k]
    return (p / full).to(torch.float8_e4m3fn), scale


def _write_fp8_dir(tmp_path, fmt: str, model, block=BLOCK):
    """The float checkpoint rewritten in an FP8 format's documented safetensors layout:
    e4m3 `weight` [out, in] + `weight_scale` (compressed-tensors: [out, 1] per channel;
    'fp8': a per-tensor scalar, with a static `input_scale`; the "-block" formats: one
    scale per BLOCK, named weight_scale_inv in 'fp8')."""
    import torch
    from safetensors.torch import load_file, save_file
    out = {}
    float_dir = tmp_path / "float"  # the saved names (transformers 5 fuses experts in memory)
    saved = {n: t for f in sorted(float_dir.glob("*.safetensors")) for n, t in
             load_file(str(f)).items()}
    for name, p in saved.items():
        p = p.detach().float()
        if not name.endswith(tuple(f"{n}.weight" for n in _PROJ)):
            out[name] = p.contiguous()
            continue
        if fmt.endswith("-block"):
            out[name], scale = _block_quantize(p, block)
            leaf = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
            out[name.replace(".weight", "." + leaf)] = scale
            continue
        per_channel = fmt == "compressed-tensors"
        amax = p.abs().amax(dim=1, keepdim=True) if per_channel else p.abs().amax()
        scale = amax.clamp(min=1e-12) / FP8_MAX
        out[name] = (p / scale).to(torch.float8_e4m3fn).contiguous()
        out[name.replace(".weight", ".weight_scale")] = scale.reshape(-1, 1) if per_channel \
            else scale.reshape(())
        if not per_channel:
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.02)
    d = tmp_path / fmt
    d.mkdir()
    save_file(out, str(d / "model.safetensors"))
    hf = json.loads((tmp_path / "float" / "config.json").read_text())
    hf["quantization_config"] = {
        "compressed-tensors": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]},
        "compressed-tensors-block": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                            "block_structure": list(block), "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                      "group_size": 128, "symmetric": True,
                                      "dynamic": True}}},
            "ignore": ["lm_head"]},
        "fp8": {"quant_method": "fp8", "activation_scheme": "static"},
        "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": list(block)}}[fmt]
    (d / "config.json").write_text(json.dumps(hf))
    return d


def _assert_near_the_float_model(bundle, model):
    import torch

    from nanojax.reference import ReferenceGenerator
    ids = list(np.random.default_rng(0).integers(0, 300, size=40))
    ours = ReferenceGenerator(bundle.config, bundle.params, max_len=64).logits(ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - theirs).max() / theirs.std() < 0.5
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_fp8_checkpoints_load_and_run_close_to_the_float_model(tmp_path, fmt):
    pytest.importorskip("torch")
    model = _float_hf_dir(tmp_path)
    bundle = load_hf_dir(_write_fp8_dir(tmp_path, fmt, model), dtype="float32",
                         progress=False)
    cfg = bundle.config
    assert cfg.quantization == "fp8"
    assert cfg.activation_scale == ("static" if fmt == "fp8" else "dynamic")
    q = bundle.params["params"]["layers_0"]["q_proj"]
    assert q["weight"].dtype == FP8 and q["weight_scale"].shape == (64,)
    if fmt == "compressed-tensors":  # per channel: the same values as quantizing at load
        at_load = quantize_bundle(load_hf_dir(tmp_path / "float", dtype="float32",
                                              progress=False), "fp8")
        np.testing.assert_array_equal(
            np.asarray(q["weight"], np.float32),
            np.asarray(at_load.params["params"]["layers_0"]["q_proj"]["weight"], np.float32))
    else:
        assert float(q["input_scale"]) == pytest.approx(0.02)
        assert len(set(np.asarray(q["weight_scale"]).tolist())) == 1  # per tensor
    _assert_near_the_float_model(bundle, model)


@pytest.mark.parametrize("fmt", ["fp8-block", "compressed-tensors-block"])
def test_block_wise_fp8_checkpoints_load_requantized_per_channel(tmp_path, fmt):
    """DeepSeek-V3 / Qwen3-FP8 ('fp8' + weight_block_size, weight_scale_inv) and
    llm-compressor's FP8_BLOCK: each weight's blocks dequantized, then one scale per output
    channel; within e4m3's rounding of the stored values, and close to the float model."""
    pytest.importorskip("torch")
    model = _float_hf_dir(tmp_path)
    src = _write_fp8_dir(tmp_path, fmt, model)
    bundle = load_hf_dir(src, dtype="float32", progress=False)
    cfg = bundle.config
    assert (cfg.quantization, cfg.activation_scale) == ("fp8", "dynamic")
    from safetensors.torch import load_file
    stored = load_file(str(src / "model.safetensors"))
    leaf = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    for path, hf in [(("layers_0", "q_proj"), "model.layers.0.self_attn.q_proj"),
                     (("layers_1", "down_proj"), "model.layers.1.mlp.down_proj")]:
        node = bundle.params["params"][path[0]][path[1]]
        w8, s = np.asarray(node["weight"], np.float32), np.asarray(node["weight_scale"])
        assert node["weight"].dtype == FP8 and s.shape == (w8.shape[0],)
        sb = stored[f"{hf}.{leaf}"].numpy()
        full = np.repeat(np.repeat(sb, BLOCK[0], 0), BLOCK[1], 1)[:w8.shape[0], :w8.shape[1]]
        want = stored[f"{hf}.weight"].float().numpy() * full  # the checkpoint's values
        got = w8 * s[:, None]
        # one more rounding to e4m3: half a step (2^-4 relative) or a subnormal's half step
        assert (np.abs(got - want) <= np.abs(want) * 2.0 ** -4 + s[:, None] * 2.0 ** -10
                + 1e-12).all()
        assert np.abs(np.abs(want).max(axis=1) - np.abs(got).max(axis=1)).max() < 1e-6
    _assert_near_the_float_model(bundle, model)


@pytest.mark.parametrize("fmt", ["fp8-block", "compressed-tensors-block"])
def test_fp8_block_keeps_a_block_checkpoints_weights_as_stored(tmp_path, fmt):
    """--quantization fp8-block on a 128 x 128 block checkpoint: the stored e4m3 weights and
    block scales unchanged (no second rounding); other block sizes refused by name."""
    pytest.importorskip("torch")
    from safetensors.torch import load_file
    model = _float_hf_dir(tmp_path)
    src = _write_fp8_dir(tmp_path, fmt, model, block=(128, 128))
    bundle = load_model(str(src), dtype="float32", quantization="fp8-block")
    assert bundle.config.quantization == "fp8-block"
    stored = load_file(str(src / "model.safetensors"))
    leaf = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    down = bundle.params["params"]["layers_1"]["down_proj"]
    hf = "model.layers.1.mlp.down_proj"
    np.testing.assert_array_equal(np.asarray(down["weight"], np.float32),
                                  stored[f"{hf}.weight"].float().numpy())
    np.testing.assert_array_equal(down["weight_scale"], stored[f"{hf}.{leaf}"].numpy())
    _assert_near_the_float_model(bundle, model)
    (tmp_path / "other").mkdir()  # the same float checkpoint in 48 x 32 blocks
    (tmp_path / "other" / "float").symlink_to(tmp_path / "float")
    other = _write_fp8_dir(tmp_path / "other", fmt, model, block=BLOCK)
    with pytest.raises(CheckpointError, match="48 x 32"):
        load_model(str(other), dtype="float32", quantization="fp8-block")
    assert load_model(str(other), dtype="float32").config.quantization == "fp8"


def test_block_wise_fp8_with_a_wrong_scale_shape_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file
    src = _write_fp8_dir(tmp_path, "fp8-block", _float_hf_dir(tmp_path))
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()  # one column of blocks short
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name} has shape"):
        load_hf_dir(src, progress=False)
    del tensors[name]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks model.layers.1.mlp.up_proj.weight_scale"):
        load_hf_dir(src, progress=False)


def _edited_copy(src, dest, edit, config=None):
    """src's FP8 checkpoint with edit(tensors) applied (and config(hf) to its config.json)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dest)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"))
    if config is not None:
        hf = json.loads((src / "config.json").read_text())
        config(hf)
        (dest / "config.json").write_text(json.dumps(hf))
    return dest


def _set(name, fn):
    def edit(tensors):
        tensors[name] = fn(tensors[name]).contiguous()
    return edit


_Q = "model.layers.0.self_attn.q_proj."
_DOWN = "model.layers.1.mlp.down_proj."


def _poke(index, value):
    def fn(t):
        t = t.clone().float()
        t.view(-1)[index] = value
        return t
    return fn


def test_hostile_fp8_tensors_are_refused_by_name(tmp_path):
    """Values an FP8 checkpoint must not hold, each of which used to load and compute NaN
    logits, or a projection zeroed or sign-flipped, without a word: non-finite, zero,
    negative or overflowing scales; NaN codes or integer data in a weight; block scales
    under a per-channel config; e5m2 weights; FP8 tensors without a quantization_config."""
    import torch
    model = _float_hf_dir(tmp_path)
    ct = _write_fp8_dir(tmp_path, "compressed-tensors", model)
    static = _write_fp8_dir(tmp_path, "fp8", model)
    blocks = _write_fp8_dir(tmp_path, "fp8-block", model)
    nan_byte = lambda t: t.view(torch.uint8).clone().index_fill_(0, torch.tensor([0]), 0x7F)\
        .view(torch.float8_e4m3fn)  # noqa: E731 - row 0 all NaN codes
    cases = [
        (ct, _set(_DOWN + "weight_scale", _poke(3, float("nan"))), None,
         CheckpointError, "down_proj.weight_scale holds 1 value.* nan"),
        (ct, _set(_DOWN + "weight_scale", _poke(3, 0.0)), None, CheckpointError, "0.0"),
        (ct, _set(_DOWN + "weight_scale", lambda t: -t), None, CheckpointError, "positive"),
        (ct, _set(_DOWN + "weight_scale", _poke(0, 1e38)), None, CheckpointError, "448 x"),
        (ct, _set(_DOWN + "weight_scale", lambda t: t.to(torch.int32)), None,
         CheckpointError, "int32, not a float"),
        (ct, _set(_Q + "weight_scale", lambda t: t.reshape(8, 8)), None,  # 64 = 8 x 8
         CheckpointError, r"shape \(8, 8\); the model needs \(64,\)"),
        (ct, _set(_Q + "weight", nan_byte), None, CheckpointError, "q_proj.weight holds 64 NaN"),
        (ct, _set(_Q + "weight", lambda t: t.float().to(torch.int8)), None,
         CheckpointError, "int8 with values e4m3 cannot hold"),
        (ct, _set(_Q + "weight", lambda t: t.float().to(torch.float8_e5m2)), None,
         UnsupportedError, "F8_E5M2"),
        (ct, lambda t: None, lambda hf: hf.pop("quantization_config"),
         CheckpointError, "no quantization_config"),
        (static, _set(_DOWN + "input_scale", lambda t: t * 0), None,
         CheckpointError, "input_scale holds 1 value"),
        (static, _set(_DOWN + "input_scale", lambda t: t.reshape(1).repeat(96)), None,
         CheckpointError, "the model needs one per tensor"),
        (blocks, _set(_DOWN + "weight_scale_inv", _poke(1, float("inf"))), None,
         CheckpointError, "weight_scale_inv holds 1 value"),
        (blocks, _set(_DOWN + "weight", nan_byte), None, CheckpointError, "NaN"),
    ]
    for i, (src, edit, config, error, match) in enumerate(cases):
        bad = _edited_copy(src, tmp_path / f"bad{i}", edit, config)
        with pytest.raises(error, match=match):
            load_hf_dir(bad, dtype="float32", progress=False)
    # what the checks let through: bf16 scales, a float weight e4m3 holds exactly
    fine = _edited_copy(ct, tmp_path / "fine", lambda t: (
        _set(_DOWN + "weight_scale", lambda s: s.to(torch.bfloat16))(t),
        _set(_Q + "weight", lambda w: w.float())(t)))
    assert load_hf_dir(fine, dtype="float32", progress=False).config.quantization == "fp8"


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_quantizing_non_finite_weights_at_load_is_refused(tiny_bundle, value):
    params = jax.tree_util.tree_map(np.array, tiny_bundle.params)
    params["params"]["layers_1"]["up_proj"]["kernel"][3, 5] = value
    bundle = dataclasses.replace(tiny_bundle, params=params)
    for quant in ("fp8", "fp8-block"):
        with pytest.raises(CheckpointError, match="layers_1/up_proj .*inf or NaN"):
            quantize_bundle(bundle, quant)


def test_ignore_lists_that_keep_only_heads_and_routers_float_are_taken():
    for ignore in (["lm_head", r"re:.*mlp\.gate$", "re:.*block_sparse_moe.gate",
                    "model.layers.0.mlp.shared_expert_gate"], None,
                   # a vision tower's Linears, as llm-compressor lists them
                   ["lm_head", "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
                    "visual.blocks.0.attn.qkv", "multi_modal_projector.linear_1"]):
        assert fp8_scheme({"quantization_config": {
            "quant_method": "fp8", "modules_to_not_convert": ignore}}).quantization == "fp8"
    for fmt in ("e4m3", "float8_e4m3fn"):  # AutoFP8 / MiniMax's key: the tensors' dtype decides
        qc = {"quant_method": "fp8", "fmt": fmt}
        assert fp8_scheme({"quantization_config": qc}).quantization == "fp8"


_BLOCK_GROUP = {"weights": {"num_bits": 8, "type": "float", "strategy": "block",
                            "block_structure": [128, 128]}}


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "block-wise FP8 with static"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [2 ** 70, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": "128x128"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [True, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.3.mlp.gate_proj"]},
     "unquantized"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.3.mlp"]}, "unquantized"),
    ({"quant_method": "fp8", "ignored_layers": ["re:.*q_proj|.*mlp.gate"]}, "unquantized"),
    ({"quant_method": "fp8", "ignored_layers": ["re:(unclosed"]}, "not a regular expr"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {**_BLOCK_GROUP["weights"],
                                          "block_structure": None}}}}, "block_structure"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"a": _BLOCK_GROUP, "b": {"weights": {
          **_BLOCK_GROUP["weights"], "block_structure": [64, 64]}}}}, "different weight"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {**_BLOCK_GROUP, "input_activations": {
          "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "with block weights"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["o_proj"]}, "unquantized"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["mlp.down_proj"]}, "unquantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": [_BLOCK_GROUP]}}, "group g is list, not an object"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": "fp8"}}}, "weights is str"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                          "strategy": "channel", "symmetric": False}}}},
     "asymmetric weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                          "strategy": "group", "group_size": 128}}}},
     "strategy 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                          "strategy": "channel"}}},
      "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "unquantized"),
])
def test_unsupported_quantized_checkpoints_are_refused_by_name(qc, match):
    with pytest.raises(UnsupportedError, match=match):
        fp8_scheme({"quantization_config": qc})
    assert fp8_scheme({}) == (None, "dynamic", None)


def test_cli_info_shows_the_quantization(capsys):
    from nanojax.cli import main
    assert main(["info", "random:tiny", "--quantization", "fp8"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quantization"] == "fp8" and info["config"]["quantization"] == "fp8"
    with pytest.raises(SystemExit):
        main(["info", "random:tiny", "--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_convert_writes_fp8_with_calibrated_static_scales(tmp_path):
    """`nanojax convert --quantization fp8` with calibration: an FP8 nanojax checkpoint whose
    projections carry input_scale = the calibration absmax / 448, loaded back static and
    close to the float model; without calibration, dynamic scales."""
    import torch

    from checkpoints.loader import convert, load_model
    from nanojax.models.fp8_calibration import input_absmax
    from nanojax.reference import ReferenceGenerator
    model = _float_hf_dir(tmp_path)
    rng = np.random.default_rng(1)
    calib = [rng.integers(0, 300, int(n)).tolist() for n in (30, 12, 50)]
    convert(tmp_path / "float", tmp_path / "static", quantization="fp8", calibration=calib)
    convert(tmp_path / "float", tmp_path / "dynamic", quantization="fp8")
    static, dynamic = load_model(str(tmp_path / "static")), load_model(str(tmp_path / "dynamic"))
    with pytest.raises(CheckpointError, match="already quantized"):
        convert(tmp_path / "dynamic", tmp_path / "again", quantization="fp8", calibration=calib)
    assert not (tmp_path / "again").exists()
    assert (static.config.quantization, static.config.activation_scale) == ("fp8", "static")
    assert (dynamic.config.quantization, dynamic.config.activation_scale) == ("fp8", "dynamic")
    want = input_absmax(load_hf_dir(tmp_path / "float", dtype="float32", progress=False),
                        calib)
    down = static.params["params"]["layers_1"]["down_proj"]
    assert down["weight"].dtype == FP8
    assert float(down["input_scale"]) == pytest.approx(want[("layers_1", "down_proj")]
                                                       / FP8_MAX, rel=1e-6)
    ids = list(rng.integers(0, 300, size=40))
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    ours = ReferenceGenerator(static.config, static.params, max_len=64).logits(ids)
    assert np.abs(ours - theirs).max() / theirs.std() < 0.5


def test_convert_refuses_bad_calibration_before_loading(tmp_path, capsys):
    from nanojax.cli import main
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"txt": "hello"}\n')
    (tmp_path / "ok.txt").write_text("some text\n")
    (tmp_path / "deep.jsonl").write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (tmp_path / "surrogate.jsonl").write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n')
    src = str(tmp_path / "no-such-model")  # never read: each case fails first
    for argv, msg in [
        (["--calibration-data", str(tmp_path / "ok.txt")], "give --quantization fp8"),
        (["--quantization", "fp8", "--calibration-data", str(tmp_path / "x.txt")], "no file"),
        (["--quantization", "fp8", "--calibration-data", str(tmp_path / "empty.txt")],
         "holds no sample"),
        (["--quantization", "fp8", "--calibration-data", str(tmp_path / "bad.jsonl")],
         "KeyError"),
        (["--quantization", "fp8", "--calibration-data", str(tmp_path / "deep.jsonl")],
         "RecursionError"),
        (["--quantization", "fp8", "--calibration-data", str(tmp_path / "surrogate.jsonl")],
         "sample 2 is not valid Unicode"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["convert", src, str(tmp_path / "out"), *argv])
        assert msg in str(e.value.code), (argv, e.value.code)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="no tokenizer"):  # an HF dir without one
        from checkpoints.loader import convert
        _float_hf_dir(tmp_path)
        convert(tmp_path / "float", tmp_path / "out", quantization="fp8",
                calibration=["some text"])
    assert not (tmp_path / "out").exists()


def test_the_lm_head_writes_f32_logits_from_its_gemm():
    """The untied LM head's GEMM writes the f32 logits itself (bf16 in, f32 accumulated
    and out): no bf16 [rows, vocab] output and convert pass after it, which an H100
    profile showed as a kernel of its own (fp8.md §91)."""
    from nanojax.config import named_shape
    from nanojax.models.llama import LlamaForCausalLM, init_params
    cfg = named_shape("tiny", dtype="bfloat16")
    assert not cfg.tie_word_embeddings
    model, params = LlamaForCausalLM(cfg), init_params(cfg)
    x = jnp.zeros((4, cfg.hidden_size), jnp.bfloat16)
    eqns = jax.make_jaxpr(lambda p, x: model.apply(p, x, method=LlamaForCausalLM.logits))(
        params, x).jaxpr.eqns
    head = [e for e in eqns if e.primitive.name == "dot_general"
            and e.outvars[0].aval.shape == (4, cfg.vocab_size)]
    assert len(head) == 1 and head[0].outvars[0].aval.dtype == jnp.float32
    assert head[0].invars[1].aval.dtype == jnp.bfloat16  # the weight read as bf16
    assert not [e for e in eqns if e.primitive.name == "convert_element_type"
                and e.invars[0].aval.shape == (4, cfg.vocab_size)]
