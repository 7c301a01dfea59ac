"""The MoE grouped GEMM (jax's Hopper ragged dot in Mosaic GPU) against its f32 reference:
jax's kernel has no interpret mode, so on the CPU its lowering for CUDA at the Mixtral
shapes (Mosaic GPU's own checks run there) and the choice expert_matmul makes; on a Hopper
GPU the kernel itself, with uneven and empty groups. The FP8 grouped GEMM (our own body)
also runs in Mosaic GPU's interpret mode on the CPU against its reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanojax.models.moe import expert_matmul
from pallas_kernels.grouped_matmul_mgpu import (FP8, WIDE_TILING, GroupedTiling,
                                                fp8_tiling_for, grouped_matmul_fp8_mgpu,
                                                grouped_matmul_fp8_reference,
                                                grouped_matmul_mgpu, grouped_matmul_reference,
                                                tiling_for, unsupported, unsupported_fp8)
from pallas_kernels.mosaic_gpu_support import on_hopper


def _operands(m, k, n, sizes, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    assert sum(sizes) == m
    return (jax.random.normal(kx, (m, k), jnp.bfloat16),
            (jax.random.normal(kw, (len(sizes), k, n)) / np.sqrt(k)).astype(jnp.bfloat16),
            jnp.asarray(sizes, jnp.int32))


def test_reference_is_each_group_times_its_own_weights():
    x, w, sizes = _operands(8, 4, 3, [3, 0, 5])
    ref = np.asarray(grouped_matmul_reference(x, w, sizes))
    xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(ref[:3], xf[:3] @ wf[0], rtol=1e-5)
    np.testing.assert_allclose(ref[3:], xf[3:] @ wf[2], rtol=1e-5)


def test_shapes_it_cannot_tile_are_refused_and_expert_matmul_falls_back():
    x, w, sizes = _operands(256, 128, 256, [100, 156])
    assert unsupported(x, w) is None
    assert "M = 200" in unsupported(x[:200], w)
    assert "16-bit" in unsupported(x.astype(jnp.float32), w.astype(jnp.float32))
    assert "needs [M, K] x [G, K, N]" in unsupported(x, w[0])
    with pytest.raises(ValueError, match="N = 200"):
        grouped_matmul_mgpu(x, w[:, :, :200], sizes)
    if not on_hopper():  # the CPU (and older GPUs) take XLA's ragged_dot
        np.testing.assert_array_equal(np.asarray(expert_matmul(x, w, sizes)),
                                      np.asarray(jax.lax.ragged_dot(x, w, sizes)))


@pytest.mark.parametrize("m", [4096, 128])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096)])
def test_mixtral_expert_shapes_lower_for_cuda(m, k, n):
    """gate/up and down of B_dense 2048 at top-2 (4,096 rows, 8 experts: the wide tiling)
    and of a decode batch of 64 (128 rows: the default)."""
    assert tiling_for(m, n) == (WIDE_TILING if m > 128 else GroupedTiling())
    sd = jax.ShapeDtypeStruct
    exported = jax.export.export(grouped_matmul_mgpu, platforms=["cuda"])(
        sd((m, k), jnp.bfloat16), sd((8, k, n), jnp.bfloat16), sd((8,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()


def test_the_wide_tiling_needs_n_in_its_column_blocks():
    assert tiling_for(4096, 14336 // 8) == WIDE_TILING  # TP 8's gate/up shard: 7 blocks
    assert tiling_for(4096, 1408) == GroupedTiling()  # 5.5 blocks of 256


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[512] * 8, [0, 1000, 24, 0, 129, 2500, 0, 443]])
def test_grouped_matmul_on_gpu(sizes):
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    x, w, g = _operands(4096, 1024, 2048, sizes)
    out = np.asarray(grouped_matmul_mgpu(x, w, g), np.float64)
    ref = np.asarray(grouped_matmul_reference(x, w, g), np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


# ---- FP8 operands (W8A8 experts) ---------------------------------------------------------
def _fp8_operands(m, k, n, sizes, seed=0):
    """x8 [M, K] and w8 [G, N, K] e4m3 over their whole range, per-row and per-(group,
    column) scales of different sizes."""
    rng = np.random.default_rng(seed)
    assert sum(sizes) == m
    e4m3 = lambda shape: jnp.asarray(  # noqa: E731
        np.clip(rng.normal(size=shape) * 100, -448, 448), jnp.float32).astype(FP8)
    return (e4m3((m, k)), jnp.asarray(rng.uniform(0.5, 2, m), jnp.float32),
            e4m3((len(sizes), n, k)),
            jnp.asarray(rng.uniform(0.5, 2, (len(sizes), n)), jnp.float32),
            jnp.asarray(sizes, jnp.int32))


def test_fp8_reference_is_each_group_scaled_times_its_own_weights():
    x8, sx, w8, sw, sizes = _fp8_operands(8, 128, 4, [3, 0, 5])
    ref = np.asarray(grouped_matmul_fp8_reference(x8, sx, w8, sw, sizes))
    xd = np.asarray(x8, np.float64) * np.asarray(sx)[:, None]
    wd = np.asarray(w8, np.float64) * np.asarray(sw)[..., None]   # [G, N, K]
    tol = dict(rtol=1e-5, atol=1e-6 * np.abs(ref).max())  # f32 sums of 128 products
    np.testing.assert_allclose(ref[:3], xd[:3] @ wd[0].T, **tol)
    np.testing.assert_allclose(ref[3:], xd[3:] @ wd[2].T, **tol)


@pytest.mark.parametrize("tiling,programs", [(GroupedTiling(64, 128, 128, 2), 3),
                                             (GroupedTiling(64, 256, 128, 2), 132)],
                         ids=["64x128-3programs", "64x256"])
def test_fp8_kernel_matches_reference_interpret(tiling, programs):
    """The kernel's own body (group walk, K-major weight tiles, scales in the epilogue,
    the row ladder of stores) in Mosaic GPU's CPU interpreter: blocks straddling groups,
    empty groups first, between and last, bf16 out; on 3 programs each walks several
    tiles (the scales' barrier and buffers reused)."""
    x8, sx, w8, sw, sizes = _fp8_operands(192, 256, 256, [0, 70, 26, 0, 96, 0])
    out = np.asarray(grouped_matmul_fp8_mgpu(x8, sx, w8, sw, sizes, tiling=tiling,
                                             num_programs=programs, interpret=True),
                     np.float64)
    ref = np.asarray(grouped_matmul_fp8_reference(x8, sx, w8, sw, sizes), np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 4e-3  # bf16 output rounding
    np.testing.assert_allclose(out, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


def test_fp8_kernel_refuses_what_it_cannot_take():
    x8, sx, w8, sw, sizes = _fp8_operands(256, 256, 256, [100, 156])
    assert unsupported_fp8(x8, w8) is None
    assert fp8_tiling_for(256, 256).block_k == 128
    assert "M = 200" in unsupported_fp8(x8[:200], w8)
    assert "float8_e4m3fn" in unsupported_fp8(x8.astype(jnp.bfloat16), w8)
    assert "16-bit output" in unsupported_fp8(x8, w8, out_dtype=jnp.float32)
    assert "[G, N, K]" in unsupported_fp8(x8, w8[0])
    assert "K = 192" in unsupported_fp8(x8[:, :192], w8[:, :, :192])
    with pytest.raises(ValueError, match="N = 200"):
        grouped_matmul_fp8_mgpu(x8, sx, w8[:, :200], sw[:, :200], sizes)


@pytest.mark.parametrize("m", [4096, 128])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096)])
def test_fp8_mixtral_expert_shapes_lower_for_cuda(m, k, n):
    """Mixtral-8x7B's expert GEMMs in FP8 (gate/up 4096 -> 14336, down 14336 -> 4096) at
    B_dense 2048 x top-2 (4,096 rows: 64 x 256 tiles) and a decode batch of 64 (128 rows:
    128 x 128): Mosaic GPU compiles them and their shared memory fits."""
    sd = jax.ShapeDtypeStruct
    exported = jax.export.export(grouped_matmul_fp8_mgpu, platforms=["cuda"])(
        sd((m, k), FP8), sd((m, 1), jnp.float32), sd((8, n, k), FP8),
        sd((8, n), jnp.float32), sd((8,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()
    assert exported.out_avals[0].shape == (m, n) and exported.out_avals[0].dtype == jnp.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[512] * 8, [0, 1000, 24, 0, 129, 2500, 0, 443]])
def test_fp8_grouped_matmul_on_gpu(sizes):
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    x8, sx, w8, sw, g = _fp8_operands(4096, 1024, 2048, sizes)
    out = np.asarray(grouped_matmul_fp8_mgpu(x8, sx, w8, sw, g), np.float64)
    ref = np.asarray(grouped_matmul_fp8_reference(x8, sx, w8, sw, g), np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 4e-3
