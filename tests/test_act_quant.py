"""The fused activation-quantization kernels (pallas_kernels/act_quant.py) against their
pure-JAX references: interpret mode on the CPU, and lowered for CUDA (the Triton lowering
runs here) at the LLaMA-3-8B widths."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.act_quant import (FP8, chunk_of, quantize_rows, quantize_rows_reference,
                                      rms_norm_quant, rms_norm_quant_reference, silu_mul_quant,
                                      silu_mul_quant_reference, unsupported)


def _close_fp8(got, want):
    """Same scales; values equal but for rare one-step differences (the sums' order:
    the kernel reduces a row piece by piece)."""
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype == FP8 and q.shape == q_ref.shape
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-6)
    a, b = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
    differ = a != b
    assert differ.mean() < 0.002, differ.mean()
    # one e4m3 step: 3 mantissa bits, at most 1/8 of the value (or a subnormal's step)
    np.testing.assert_allclose(a[differ], b[differ], rtol=0.125, atol=2.0 ** -9)


@pytest.mark.parametrize("t, width, dtype", [(8, 64, jnp.float32), (5, 14336, jnp.bfloat16),
                                             (3, 4096, jnp.bfloat16)])
def test_silu_mul_quant_matches_reference_interpret(t, width, dtype):
    kg, ku = jax.random.split(jax.random.PRNGKey(width))
    gate = (3 * jax.random.normal(kg, (t, width))).astype(dtype)
    up = jax.random.normal(ku, (t, width)).astype(dtype).at[0, 5].set(40.0)  # an outlier
    _close_fp8(silu_mul_quant(gate, up, interpret=True), silu_mul_quant_reference(gate, up))


@pytest.mark.parametrize("t, width", [(8, 64), (5, 14336)])
def test_silu_mul_quant_dequantizes_its_inputs_interpret(t, width):
    """gate and up as FP8 GEMMs leave them (bf16, before their row and column scales):
    the kernel applies the scales as the reference does, and that is SiLU x up of the
    dequantized values (the same function as scaling first)."""
    kg, ku, kr, kc = jax.random.split(jax.random.PRNGKey(width + 7), 4)
    gate = (300 * jax.random.normal(kg, (t, width))).astype(jnp.bfloat16)
    up = (300 * jax.random.normal(ku, (t, width))).astype(jnp.bfloat16)
    row = jax.random.uniform(kr, (t, 1), minval=1e-3, maxval=2e-2)
    cols = jax.random.uniform(kc, (2, width), minval=1e-3, maxval=2e-2)
    scales = (row, cols[0], cols[1])
    got = silu_mul_quant(gate, up, scales, interpret=True)
    _close_fp8(got, silu_mul_quant_reference(gate, up, scales))
    g = gate.astype(jnp.float32) * row * cols[0]
    u = up.astype(jnp.float32) * row * cols[1]
    _close_fp8(got, silu_mul_quant_reference(g, u))


@pytest.mark.parametrize("t, width", [(8, 64), (5, 14336)])
def test_silu_mul_quant_two_pass_gives_the_one_pass_bits_interpret(t, width):
    """two_pass re-reads the row instead of holding it: the same values in the same
    order, so the same bits, with and without the inputs' scales."""
    kg, ku = jax.random.split(jax.random.PRNGKey(width + 3))
    gate = (3 * jax.random.normal(kg, (t, width))).astype(jnp.bfloat16)
    up = jax.random.normal(ku, (t, width)).astype(jnp.bfloat16).at[1, 7].set(-50.0)
    scales = (jnp.linspace(0.01, 0.03, t)[:, None], jnp.full((width,), 0.5),
              jnp.linspace(0.2, 0.9, width))
    for sc in (None, scales):
        one = silu_mul_quant(gate, up, sc, interpret=True)
        two = silu_mul_quant(gate, up, sc, two_pass=True, interpret=True)
        assert np.array_equal(np.asarray(one[0], np.float32), np.asarray(two[0], np.float32))
        assert np.array_equal(np.asarray(one[1]), np.asarray(two[1]))
    _close_fp8(two, silu_mul_quant_reference(gate, up, scales))


def test_silu_mul_quant_pieces_of_any_power_of_2_give_the_same_bits_interpret():
    """chunk: the row in pieces of up to 4,096 or 8,192 columns (14,336 = 3 x 4,096 +
    2,048) computes the same values as the default 2,048, scaled or not; a chunk that is
    not a power of 2, or with two_pass, is refused."""
    t, width = 3, 14336
    kg, ku = jax.random.split(jax.random.PRNGKey(11))
    gate = (3 * jax.random.normal(kg, (t, width))).astype(jnp.bfloat16)
    up = jax.random.normal(ku, (t, width)).astype(jnp.bfloat16).at[2, 14000].set(60.0)
    scales = (jnp.full((t, 1), 0.02), jnp.linspace(0.1, 0.9, width), jnp.full((width,), 0.5))
    for sc in (None, scales):
        base = silu_mul_quant(gate, up, sc, interpret=True)
        for chunk in (4096, 8192):
            got = silu_mul_quant(gate, up, sc, chunk=chunk, interpret=True)
            assert np.array_equal(np.asarray(got[0], np.float32), np.asarray(base[0], np.float32))
            assert np.array_equal(np.asarray(got[1]), np.asarray(base[1]))
    for bad in (dict(chunk=3000), dict(chunk=4096, two_pass=True)):
        with pytest.raises(ValueError, match="chunk"):
            silu_mul_quant(gate, up, interpret=True, **bad)


def test_rows_a_program_give_the_one_row_bits_interpret():
    """rows: a program takes 2, 4 or 8 rows as [rows, piece] tiles (the column scales
    loaded once for them): the same values in the same order as one row a program, so
    the same bits, scaled or not, one pass or two (RMSNorm's sum of squares may add in
    another order: within rounding there); rows that are not a power of 2 dividing the
    tokens are refused."""
    t, width = 8, 14336
    kg, ku = jax.random.split(jax.random.PRNGKey(21))
    gate = (3 * jax.random.normal(kg, (t, width))).astype(jnp.bfloat16)
    up = jax.random.normal(ku, (t, width)).astype(jnp.bfloat16).at[5, 3].set(45.0)
    scales = (jnp.linspace(0.01, 0.03, t)[:, None], jnp.linspace(0.2, 0.9, width),
              jnp.full((width,), 0.5))

    def same(a, b):
        assert np.array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
        assert np.array_equal(np.asarray(a[1]), np.asarray(b[1]))
    for sc in (None, scales):
        for two in (False, True):
            one = silu_mul_quant(gate, up, sc, two_pass=two, interpret=True)
            for rows in (2, 4, 8):
                same(silu_mul_quant(gate, up, sc, two_pass=two, rows=rows, interpret=True), one)
    x = (5 * jax.random.normal(kg, (t, 4096))).astype(jnp.bfloat16).at[2].set(0)
    w = jnp.linspace(0.5, 1.5, 4096).astype(jnp.bfloat16)
    for rows in (2, 4):
        same(quantize_rows(x, rows=rows, interpret=True), quantize_rows(x, interpret=True))
        _close_fp8(rms_norm_quant(x, w, 1e-5, rows=rows, interpret=True),
                   rms_norm_quant(x, w, 1e-5, interpret=True))
    for rows in (3, 16):
        with pytest.raises(ValueError, match="rows"):
            quantize_rows(x, rows=rows, interpret=True)


@pytest.mark.parametrize("t, width, dtype", [(8, 64, jnp.float32), (4, 4096, jnp.bfloat16)])
def test_rms_norm_quant_matches_reference_interpret(t, width, dtype):
    kx, kw = jax.random.split(jax.random.PRNGKey(width + 1))
    x = (10 * jax.random.normal(kx, (t, width))).astype(dtype)
    x = x.at[1].set(0)  # an all-zero row: scale MIN_SCALE / 448, zeros out
    w = (1 + 0.1 * jax.random.normal(kw, (width,))).astype(dtype)
    got = rms_norm_quant(x, w, 1e-5, interpret=True)
    _close_fp8(got, rms_norm_quant_reference(x, w, 1e-5))
    assert not np.asarray(got[0][1], np.float32).any()


@pytest.mark.parametrize("t, width, dtype", [(8, 64, jnp.float32), (3, 4096, jnp.bfloat16)])
def test_quantize_rows_matches_reference_interpret(t, width, dtype):
    x = (5 * jax.random.normal(jax.random.PRNGKey(width + 2), (t, width))).astype(dtype)
    x = x.at[0].set(0).at[1, 9].set(-70.0)  # an all-zero row, an outlier
    got = quantize_rows(x, interpret=True)
    _close_fp8(got, quantize_rows_reference(x))
    assert not np.asarray(got[0][0], np.float32).any()


def test_widths_the_kernels_cannot_take_are_refused():
    assert chunk_of(14336) == 2048 and chunk_of(4096) == 2048 and chunk_of(7168) == 1024
    assert unsupported(100) is not None and unsupported(2048 * 17) is not None
    with pytest.raises(ValueError, match="pieces"):
        silu_mul_quant(jnp.zeros((2, 100)), jnp.zeros((2, 100)), interpret=True)


@pytest.mark.parametrize("which, width, rows", [
    ("silu", 14336, 1), ("silu", 7168, 1), ("rms", 4096, 1), ("scaled", 14336, 1),
    ("two_pass", 14336, 1), ("quantize_rows", 4096, 1), ("scaled", 14336, 4),
    ("two_pass", 14336, 4), ("rms", 4096, 4), ("quantize_rows", 4096, 4)])
def test_kernels_lower_for_cuda(which, width, rows):
    """The Triton lowering of the kernels at the 8B's widths (and the intermediate
    size's half under TP 2; silu_mul_quant with its inputs' scales too; one row a
    program and four, as [4, piece] tiles), on the CPU."""
    from jax import export
    sd = jax.ShapeDtypeStruct
    x = sd((2048, width), jnp.bfloat16)
    if which == "silu":
        f, args = jax.jit(silu_mul_quant), (x, x)
    elif which in ("two_pass", "scaled"):
        f = jax.jit(lambda g, u, r, gc, uc: silu_mul_quant(
            g, u, (r, gc, uc), two_pass=which == "two_pass", rows=rows))
        args = (x, x, sd((2048, 1), jnp.float32), sd((width,), jnp.float32),
                sd((width,), jnp.float32))
    elif which == "quantize_rows":
        f, args = jax.jit(lambda x: quantize_rows(x, rows=rows)), (x,)
    else:
        f = jax.jit(lambda x, w: rms_norm_quant(x, w, 1e-5, rows=rows))
        args = (x, sd((width,), jnp.bfloat16))
    exp = export.export(f, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    name = {"rms": "rms_norm_quant", "quantize_rows": "quantize_rows"}.get(which, "silu_mul_quant")
    assert name in exp.mlir_module()
    assert exp.out_avals[0].dtype == FP8 and exp.out_avals[1].shape == (2048, 1)
    assert f"grid_x = {2048 // rows} " in exp.mlir_module()


def test_engine_with_fused_quantization_gives_the_xla_quantizations_tokens(tiny_bundle):
    """The FP8 model with its projections' inputs quantized by the fused kernels
    (KernelConfig.act_quant 'pallas', interpreted here) gives the greedy tokens of XLA's
    quantization, and its logits within rounding of them."""
    from nanojax.config import KernelConfig
    from nanojax.engine.llm import LLM
    from nanojax.engine.sampling import SamplingParams
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 41], list(range(100, 130))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in ("xla", "pallas"):
        llm = LLM(tiny_bundle, quantization="fp8", b_dense=32, max_model_len=64,
                  kernels=KernelConfig(act_quant=mode))
        assert llm.engine.runner.forward.act_quant == mode
        outs[mode] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs["xla"], outs["pallas"]):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([x["logprob"] for x in a.outputs[0].logprobs],
                                   [x["logprob"] for x in b.outputs[0].logprobs], atol=2e-2)


def test_the_gpu_forward_runs_the_kernels_its_config_names(tiny_bundle, monkeypatch):
    """The GPU's straight-line forward (UnrolledForward, interpreted here) quantizes the FP8
    projections' inputs where act_quant says, with the tokens of XLA's quantization. Its
    layers once kept the model's default (XLA's passes) whatever the KernelConfig said, so
    the engine on a GPU never ran the fused kernels only the plan executor's steps had."""
    import pallas_kernels.act_quant as aq
    from nanojax.engine.forward import UnrolledForward
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.sampling import SamplingParams
    from nanojax.models.bundle import quantize_bundle
    bundle = quantize_bundle(tiny_bundle, "fp8")
    calls = []
    kernels = {"silu_mul_quant", "rms_norm_quant", "quantize_rows"}
    for name in kernels:
        real = getattr(aq, name)
        monkeypatch.setattr(aq, name, lambda *a, _f=real, _n=name, **k: (
            calls.append(_n), _f(*a, **{**k, "interpret": True}))[1])
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(100, 130))]
    outs = {}
    for mode in ("xla", "pallas"):
        calls.clear()
        fwd = UnrolledForward(bundle.config)
        fwd.act_quant = mode
        assert fwd.for_shard(bundle.config, "tp").model.act_quant == mode
        eng = LLMEngine(bundle, EngineConfig(b_dense=32, num_pages=48, page_size=4,
                                             max_model_len=64, step_cache=False),
                        forward=fwd)  # (a stored step would skip the trace counted here)
        ids = [eng.add_request(p, SamplingParams(max_tokens=4, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        outs[mode] = [done[i].token_ids for i in ids]
        assert (set(calls) == kernels) == (mode == "pallas")
        assert calls or mode == "xla"
    assert outs["xla"] == outs["pallas"]
