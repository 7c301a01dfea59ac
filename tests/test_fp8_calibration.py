"""Static FP8 activation scales from a calibration pass (nanojax/models/fp8_calibration.py)."""
import numpy as np
import pytest


def _seqs(n=6, vocab=512):
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, int(k)).tolist() for k in rng.integers(5, 30, n)]


def test_absmax_covers_every_projection_and_matches_a_direct_computation():
    """Every FP8 projection of every layer gets its input absmax; layer 0's q_proj input
    is RMSNorm(embedding) of the tokens, computed here without the model."""
    from checkpoints.loader import load_model
    from nanojax.layers.fp8 import FP8_PROJECTIONS
    from nanojax.models.fp8_calibration import input_absmax
    bundle = load_model("random:tiny")
    seqs = _seqs()
    absmax = input_absmax(bundle, seqs, group=3)
    cfg, p = bundle.config, bundle.params["params"]
    want = {(f"layers_{i}", n) for i in range(cfg.num_layers) for n in FP8_PROJECTIONS
            if n in p[f"layers_{i}"]}
    assert set(absmax) == want and all(v > 0 for v in absmax.values())
    emb = np.asarray(p["embed"]["embedding"], np.float32)[np.concatenate(seqs)]
    norm = emb / np.sqrt(np.mean(emb * emb, -1, keepdims=True) + cfg.rms_norm_eps)
    direct = np.abs(norm * np.asarray(p["layers_0"]["input_norm"]["scale"])).max()
    assert absmax[("layers_0", "q_proj")] == pytest.approx(direct, rel=1e-5)
    assert absmax[("layers_0", "q_proj")] == absmax[("layers_0", "v_proj")]  # one input


def test_padding_tokens_are_not_calibrated():
    """The packing pads each batch to one shape; the same sequences packed 1 or 6 to a
    batch (different padding) give the same absmax."""
    from checkpoints.loader import load_model
    from nanojax.models.fp8_calibration import input_absmax
    bundle = load_model("random:tiny")
    one, six = input_absmax(bundle, _seqs(), group=1), input_absmax(bundle, _seqs(), group=6)
    assert one.keys() == six.keys()
    for k in one:
        assert one[k] == pytest.approx(six[k], rel=1e-5), k


def test_static_scales_go_into_the_fp8_bundle():
    from checkpoints.loader import load_model
    from nanojax.layers.fp8 import FP8_MAX
    from nanojax.models.bundle import quantize_bundle
    from nanojax.models.fp8_calibration import input_absmax, with_static_scales
    bundle = load_model("random:tiny")
    absmax = input_absmax(bundle, _seqs(3), group=3)
    fp8 = quantize_bundle(bundle, "fp8")
    static = with_static_scales(fp8, absmax)
    assert static.config.activation_scale == "static" and static.config.quantization == "fp8"
    node = static.params["params"]["layers_1"]["down_proj"]
    assert float(node["input_scale"]) == pytest.approx(absmax[("layers_1", "down_proj")]
                                                       / FP8_MAX)
    assert "input_scale" not in fp8.params["params"]["layers_1"]["down_proj"]  # not mutated
    with pytest.raises(ValueError, match="no calibration absmax for layers_0/q_proj"):
        with_static_scales(fp8, {k: v for k, v in absmax.items()
                                 if k != ("layers_0", "q_proj")})
    with pytest.raises(ValueError, match="already quantized"):
        input_absmax(fp8, _seqs(2))
    with pytest.raises(ValueError, match="static scales go on an FP8 bundle"):
        with_static_scales(bundle, absmax)
    with pytest.raises(ValueError, match="at least one token"):
        input_absmax(bundle, [[1, 2], []])
