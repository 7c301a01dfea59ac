"""The fused RoPE + KV-append Pallas kernel against its pure-JAX reference."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanojax.layers.rotary import inverse_frequencies
from pallas_kernels.rope_append import rope_append, rope_append_reference


def _case(rng, t, kvh, d, ps, num_pages, dtype):
    slots = rng.permutation(num_pages * ps)[:t].astype(np.int32)
    slots[rng.random(t) < 0.2] = -1  # padding rows write nothing
    positions = rng.integers(0, 4096, t).astype(np.int32)
    k = jnp.asarray(rng.standard_normal((t, kvh, d)), dtype)
    v = jnp.asarray(rng.standard_normal((t, kvh, d)), dtype)
    kp = jnp.asarray(rng.standard_normal((num_pages, kvh, ps, d)), dtype)
    vp = jnp.asarray(rng.standard_normal((num_pages, kvh, ps, d)), dtype)
    return k, v, kp, vp, jnp.asarray(positions), jnp.asarray(slots)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.integers(1, 24), kvh=st.sampled_from([1, 2, 4]), d=st.sampled_from([8, 32, 64]),
       ps=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference_interpret(t, kvh, d, ps, seed):
    rng = np.random.default_rng(seed)
    num_pages = -(-t // ps) + 2
    k, v, kp, vp, pos, slots = _case(rng, t, kvh, d, ps, num_pages, jnp.float32)
    inv_freq = inverse_frequencies(d, 500000.0)
    want = rope_append_reference(k, v, kp, vp, pos, slots, inv_freq)
    got = rope_append(k, v, kp, vp, pos, slots, inv_freq, interpret=True)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert np.isfinite(g).all()
        # cos/sin of angles up to ~4096 rad in f32: a few ulps of the angle
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_kernel_on_gpu_bf16():
    rng = np.random.default_rng(0)
    k, v, kp, vp, pos, slots = _case(rng, 2048, 8, 128, 16, 256, jnp.bfloat16)
    inv_freq = inverse_frequencies(128, 500000.0)
    want = rope_append_reference(k, v, kp, vp, pos, slots, inv_freq)
    got = rope_append(k, v, kp, vp, pos, slots, inv_freq)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kvh,d,fused", [(2, 64, True), (3, 64, False), (4, 96, False)])
def test_the_engine_append_lowers_for_cuda_fused_only_where_triton_takes_the_shapes(
        kvh, d, fused):
    """The fused append is the GPU default: for shapes Pallas' Triton lowering refuses
    (SmolLM2-135M's 3 kv heads failed the engine's GPU test) the append falls back to
    XLA's scatters. Lowered for CUDA here, on the CPU: the Triton lowering runs."""
    import jax
    from jax import export
    from nanojax.layers.attention import PagedMetadata, append_kv_pallas
    from pallas_kernels.rope_append import unsupported
    sd, t, ps = jax.ShapeDtypeStruct, 16, 16
    kv = (sd((8, kvh, ps, d), jnp.bfloat16),) * 2
    i32 = sd((t,), jnp.int32)
    meta = PagedMetadata(i32, i32, i32, sd((4, 2), jnp.int32), sd((4,), jnp.int32),
                         sd((), jnp.int32))
    assert (unsupported(sd((t, kvh, d), jnp.bfloat16), kv[0]) is None) == fused
    inv_freq = inverse_frequencies(d, 10000.0)
    f = jax.jit(lambda k, v, kv, meta: append_kv_pallas(k, v, kv, meta, inv_freq))
    text = export.export(f, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        sd((t, kvh, d), jnp.bfloat16), sd((t, kvh, d), jnp.bfloat16), kv, meta).mlir_module()
    assert ("rope_kv_append" in text) == fused
