"""The Pallas paged decode-attention kernel against its pure-JAX reference (interpret mode
on the CPU; the same checks compiled on a GPU when there is one)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.decode_attention import decode_attention, decode_attention_reference

# f32 inputs in interpret mode: only summation order differs.
REL_TOL_F32 = 1e-5
# bf16 inputs on the GPU (f32 accumulation): a few ulps of bf16 in the output.
REL_TOL_BF16 = 1e-2


def _case(rng, b, h, kvh, d, ps, max_pages, dtype):
    n = b * max_pages + 3
    pt = rng.permutation(n)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    lens = rng.integers(1, max_pages * ps + 1, size=b).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((n, kvh, ps, d)), dtype)
    v = jnp.asarray(rng.standard_normal((n, kvh, ps, d)), dtype)
    return q, k, v, jnp.asarray(pt), jnp.asarray(lens)


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "NaN or inf in the kernel output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 5), kvh=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4, 8]),
       d=st.sampled_from([16, 32, 64]), ps=st.sampled_from([4, 8, 16]),
       max_pages=st.integers(1, 6), programs=st.integers(1, 12),
       ppb=st.sampled_from([1, 2, 4]), prefetch=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_matches_reference_interpret(b, kvh, group, d, ps, max_pages, programs, ppb,
                                            prefetch, seed):
    rng = np.random.default_rng(seed)
    q, k, v, pt, lens = _case(rng, b, kvh * group, kvh, d, ps, max_pages, jnp.float32)
    with jax.default_matmul_precision("float32"):  # no TF32 when this runs on a GPU
        out = decode_attention(q, k, v, pt, lens, num_programs=programs,
                               pages_per_block=ppb, prefetch=prefetch, interpret=True)
        ref = decode_attention_reference(q, k, v, pt, lens)
    assert out.shape == ref.shape
    assert _rel(out, ref) < REL_TOL_F32


@pytest.mark.parametrize("prefetch", [False, True])
def test_every_output_row_is_written(prefetch):
    """Output starts as garbage nowhere: a NaN poison in unused pages never leaks, and
    contexts of one token attend to exactly that token."""
    rng = np.random.default_rng(0)
    q, k, v, pt, lens = _case(rng, 3, 8, 2, 32, 8, 4, jnp.float32)
    used = np.zeros(k.shape[0], bool)
    for i, n in enumerate(np.asarray(lens)):
        used[np.asarray(pt)[i, : -(-n // 8)]] = True
    k = k.at[~used].set(jnp.nan)
    v = v.at[~used].set(jnp.nan)
    lens = lens.at[0].set(1)
    out = decode_attention(q, k, v, pt, lens, num_programs=2, prefetch=prefetch,
                           interpret=True)
    assert np.isfinite(np.asarray(out)).all()
    first = v[pt[0, 0], :, 0]  # one key: the output is its value, per kv head
    np.testing.assert_allclose(np.asarray(out[0]).reshape(2, 4, 32),
                               np.repeat(np.asarray(first)[:, None], 4, 1), rtol=1e-6)


def test_result_does_not_depend_on_the_grid():
    """Every share (program count) and the prefetch setting sum in the same order, so the
    pipeline's modes and plans with different shares give bitwise the same output."""
    rng = np.random.default_rng(3)
    q, k, v, pt, lens = _case(rng, 5, 8, 2, 32, 16, 9, jnp.float32)
    outs = [np.asarray(decode_attention(q, k, v, pt, lens, num_programs=n, prefetch=p,
                                        interpret=True))
            for n, p in ((None, False), (3, True), (1, False), (7, None))]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("b,ctx,ps,programs", [(64, 1024, 16, 66), (7, 300, 16, None),
                                               (33, 777, 64, 132)])
def test_kernel_on_gpu_bf16(b, ctx, ps, programs, prefetch):
    rng = np.random.default_rng(1)
    q, k, v, pt, lens = _case(rng, b, 32, 8, 128, ps, -(-ctx // ps), jnp.bfloat16)
    out = decode_attention(q, k, v, pt, lens, num_programs=programs, prefetch=prefetch)
    full = decode_attention(q, k, v, pt, lens, num_programs=None, prefetch=False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(full))  # any grid, same sum
    ref = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), pt, lens)
    assert _rel(out, ref) < REL_TOL_BF16


def test_a_pool_past_int32_offsets_is_refused_before_it_runs():
    """The Triton kernels address the pool with int32 element offsets: on the H200 a pool
    of 262,144 FP8 pages (2^32 elements) faulted. Traced only (eval_shape): nothing is
    allocated."""
    from pallas_kernels.decode_attention import MAX_POOL_ELEMENTS, decode_attention_impl
    from nanojax.config import named_shape
    from nanojax.engine.kv_cache import max_addressable_pages, size_cache
    from nanojax.errors import ConfigError
    q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
    pt = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)

    def run(pages):
        pool = jax.ShapeDtypeStruct((pages, 8, 16, 128), jnp.bfloat16)
        return jax.eval_shape(lambda *a: decode_attention_impl(*a, interpret=True),
                              q, pool, pool, pt, lens)

    fits = MAX_POOL_ELEMENTS // (8 * 16 * 128)
    assert run(fits).shape == (4, 32, 128)
    with pytest.raises(ValueError, match="int32 offsets"):
        run(fits + 1)
    # the engine sizes its pool inside the limit, and refuses an explicit pool past it
    cfg = named_shape("llama3-8b")
    assert max_addressable_pages(cfg, 16) == fits
    assert size_cache(cfg, 16, 2048, 2048, memory_bytes=1 << 50).num_pages == fits
    with pytest.raises(ConfigError, match="address"):
        size_cache(cfg, 16, 2048, 2048, num_pages=fits + 1)
