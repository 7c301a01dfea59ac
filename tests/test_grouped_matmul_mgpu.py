"""The MoE grouped GEMM (jax's Hopper ragged dot in Mosaic GPU) against its f32 reference:
jax's kernel has no interpret mode, so on the CPU its lowering for CUDA at the Mixtral
shapes (Mosaic GPU's own checks run there) and the choice expert_matmul makes; on a Hopper
GPU the kernel itself, with uneven and empty groups."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanojax.models.moe import expert_matmul
from pallas_kernels.grouped_matmul_mgpu import (WIDE_TILING, GroupedTiling,
                                                grouped_matmul_mgpu, grouped_matmul_reference,
                                                tiling_for, unsupported)
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
