"""GGUF blocks kept quantized on the CPU (--cpu-weights q4): the same weight values as the
f32 import, projections within rounding of the f32 ones, the same greedy tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.gguf_import import load_gguf, load_quantized
from nanojax.config import EngineConfig, KernelConfig, ModelConfig
from nanojax.engine.llm import LLM
from nanojax.engine.sampling import SamplingParams
from nanojax.errors import ConfigError
from nanojax.layers.quant import dequantize, quantized_dot
from nanojax.models import init_params
from nanojax.models.bundle import cpu_params
from tests.gguf_fixtures import write_llama_gguf

CFG = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")


def _gguf(tmp_path, quant: str, tied: bool = False):
    cfg = CFG.replace(tie_word_embeddings=tied)
    params = jax.tree_util.tree_map(np.asarray, init_params(cfg, seed=5))
    path = tmp_path / f"tiny-{quant}-{tied}.gguf"
    write_llama_gguf(path, cfg, params, quant)
    bundle = load_gguf(path, dtype="float32", progress=False)
    assert bundle.config.tie_word_embeddings == tied
    return bundle


def _kernels(bundle):
    """(quant tree path, f32 weight [out, in]) of every projection and the LM head."""
    p = bundle.params["params"]
    out = [(("tied_embed",), p["embed"]["embedding"]) if bundle.config.tie_word_embeddings
           else (("lm_head",), p["lm_head"]["kernel"].T)]
    for i in range(CFG.num_layers):
        for name, node in p[f"layers_{i}"].items():
            if "kernel" in node:
                out.append(((f"layers_{i}", name), node["kernel"].T))
    return out


@pytest.mark.parametrize("quant,tied", [("Q4_1", False), ("Q8_0", False), ("Q4_1", True)])
def test_kept_blocks_hold_the_imported_f32_values(quant, tied, tmp_path):
    """Bit-exact: d * q + m in f32 is the expression gguf's dequantize evaluates (numpy),
    and XLA's CPU evaluates it the same (no contraction into an FMA: checked here)."""
    bundle = _gguf(tmp_path, quant, tied)
    tree = load_quantized(bundle.gguf, bundle.config)
    kernels = _kernels(bundle)
    assert len(kernels) == 1 + 7 * CFG.num_layers
    for path, want in kernels:
        w = tree
        for k in path:
            w = w[k]
        assert w["q"].dtype == np.int8 and w["q"].shape[-1] == 32
        assert ("m" in w) == (quant == "Q4_1")
        np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(w)), want,
                                      err_msg=str(path))


def test_other_block_types_stay_f32(tmp_path):
    bundle = _gguf(tmp_path, "Q4_0")
    assert load_quantized(bundle.gguf, bundle.config) == {}
    assert "quant" not in cpu_params(bundle, KernelConfig(), on_gpu=False)


@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_dot_is_the_f32_product_up_to_summation_order(rows, tmp_path):
    """The fused GEMV sums the same f32 products as the f32 dot in another order: the
    difference is bounded by a few ulps of sum |x_i w_i| (not by |y|, which may cancel)."""
    bundle = _gguf(tmp_path, "Q4_1")
    tree = load_quantized(bundle.gguf, bundle.config)
    x = np.random.default_rng(0).standard_normal((rows, CFG.intermediate_size), np.float32)
    w = tree["layers_1"]["down_proj"]
    f32 = np.asarray(bundle.params["params"]["layers_1"]["down_proj"]["kernel"])
    got = np.asarray(jax.jit(quantized_dot)(jnp.asarray(x), w))
    want = np.asarray(jnp.dot(x, f32))
    scale = np.abs(x).astype(np.float64) @ np.abs(f32).astype(np.float64)
    assert got.shape == want.shape == (rows, CFG.hidden_size)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    assert np.abs(want).max() > 1e-3  # not a vacuous comparison of zeros


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_tokens_from_q4_blocks_equal_f32(tied, tmp_path):
    """Through LLM.generate: one stream decodes from the blocks (1-row steps), a batch of
    three mixes block steps with f32 ones; the tokens equal the f32 engine's. Tied: the
    LM head is the embedding's blocks."""
    bundle = _gguf(tmp_path, "Q4_1", tied)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 42, 99], [7, 8], [200, 3, 3, 61, 14, 15, 90]]
    out = {}
    for weights in ("q4", "f32"):
        llm = LLM(bundle, config=EngineConfig(kernels=KernelConfig(cpu_weights=weights)))
        assert ("quant" in llm.engine.runner.params) == (weights == "q4")
        one = llm.generate([prompts[0]], sp, use_tqdm=False)
        many = llm.generate(prompts, sp, use_tqdm=False)
        out[weights] = [o.token_ids for o in one + many]
    assert all(len(t) == 12 for t in out["q4"])
    assert out["q4"] == out["f32"]


def test_cpu_weights_config_is_checked():
    with pytest.raises(ConfigError, match="CPU weights"):
        KernelConfig(cpu_weights="q8")
    with pytest.raises(ConfigError, match="cpu_quant_max_rows"):
        KernelConfig(cpu_quant_max_rows=0)


def test_the_unpacked_blocks_are_cached_and_reread_identically(tmp_path):
    """cached_quantized: the first call reads the GGUF and stores one .npz; the second
    reads the .npz (the GGUF reader is not called) and gives the same arrays; a changed
    file is a new key."""
    from unittest import mock
    from checkpoints import gguf_import
    bundle = _gguf(tmp_path, "Q4_1")
    path = tmp_path / "tiny-Q4_1-False.gguf"
    first = gguf_import.cached_quantized(path, bundle.config, root=tmp_path / "c")
    assert len(list((tmp_path / "c" / "quant").glob("*.npz"))) == 1
    with mock.patch("checkpoints.gguf_import.load_quantized",
                    side_effect=AssertionError("read the GGUF again")):
        again = gguf_import.cached_quantized(path, bundle.config, root=tmp_path / "c")
    flat = lambda t: dict(jax.tree_util.tree_leaves_with_path(t))  # noqa: E731
    a, b = flat(first), flat(again)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    path.touch()
    import os
    os.utime(path, ns=(1, 1))  # another mtime: another key, read from the file again
    gguf_import.cached_quantized(path, bundle.config, root=tmp_path / "c")
    assert len(list((tmp_path / "c" / "quant").glob("*.npz"))) == 2
