"""The block-scaled FP8 GEMM (Mosaic GPU; DeepSeek-V3 / Qwen3-FP8 checkpoints' W8A8
function) against its f32 reference: the reference against a float64 statement of the
function, the kernel in Mosaic GPU's CPU interpreter, its CUDA lowering at Qwen3-8B's
projection shapes, and on a Hopper GPU the kernel itself."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_fp8_matmul_mgpu import (FP8, GROUP, BlockTiling,
                                                  block_fp8_matmul_mgpu,
                                                  block_fp8_matmul_reference,
                                                  quantize_groups, unsupported)
from pallas_kernels.mosaic_gpu_support import on_hopper


def _operands(m, k, n, seed=0):
    """Activations whose K groups span different ranges, block weights whose scales vary
    by block (so a scale applied to the wrong group or block shows)."""
    kx, kw, ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (m, k)) * jnp.linspace(0.1, 3.0, k)
    x8, sx = quantize_groups(x)
    nb, kb = -(-n // GROUP), k // GROUP
    w = jax.random.normal(kw, (nb * GROUP, k)) / np.sqrt(k)
    wb = w.reshape(nb, GROUP, kb, GROUP)
    sw = jnp.abs(wb).max(axis=(1, 3)) / 448.0 * jnp.exp(jax.random.normal(ks, (nb, kb)))
    w8 = jnp.clip(wb / sw[:, None, :, None], -448, 448).astype(FP8).reshape(nb * GROUP, k)
    return x8, sx, w8[:n], sw


def test_quantize_groups_scales_each_128_wide_group_to_448():
    x = jnp.concatenate([jnp.full((2, 128), 0.5), jnp.full((2, 128), -20.0)], axis=1)
    x8, sx = quantize_groups(x)
    np.testing.assert_allclose(sx, [[0.5 / 448, 20 / 448]] * 2, rtol=1e-6)
    assert float(jnp.abs(x8.astype(jnp.float32)).max()) == 448.0


def test_reference_is_the_block_scaled_sum_over_groups():
    x8, sx, w8, sw = _operands(8, 384, 200)  # N 200: a partial block of rows
    ref = np.asarray(block_fp8_matmul_reference(x8, sx, w8, sw), np.float64)
    xq, wq = np.asarray(x8, np.float64), np.asarray(w8, np.float64)
    sx, sw = np.asarray(sx, np.float64), np.asarray(sw, np.float64)
    want = np.zeros((8, 200))
    for g in range(3):
        cols = slice(g * 128, (g + 1) * 128)
        want += (xq[:, cols] @ wq[:, cols].T) * sx[:, g:g + 1] * np.repeat(sw[:, g], 128)[:200]
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("programs", [3, 132])
def test_kernel_matches_reference_interpret(programs):
    """The kernel's body (the K loop's per-group promotion, the scales' TMA'd vectors, the
    persistent tile walk: 3 programs each take several of the 2 x 4 tiles)."""
    x8, sx, w8, sw = _operands(128, 384, 512)
    out = np.asarray(block_fp8_matmul_mgpu(x8, sx, w8, sw, num_programs=programs,
                                           interpret=True), np.float64)
    ref = np.asarray(block_fp8_matmul_reference(x8, sx, w8, sw), np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 4e-3  # bf16 output rounding
    np.testing.assert_allclose(out, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())
    # a scale applied per tile rather than per K group would be far off
    flat = np.asarray(block_fp8_matmul_reference(x8, jnp.broadcast_to(sx.mean(1, keepdims=True),
                                                                      sx.shape), w8, sw))
    assert np.linalg.norm(flat - ref) / np.linalg.norm(ref) > 0.05


def test_what_it_cannot_take_is_refused():
    x8, sx, w8, sw = _operands(64, 256, 256)
    assert unsupported(x8, w8, sw) is None
    assert "M = 100" in unsupported(jnp.concatenate([x8, x8])[:100], w8)
    assert "K = 192" in unsupported(x8[:, :192], w8[:, :192])
    assert "N = 192" in unsupported(x8, w8[:192])
    assert "float8_e4m3fn" in unsupported(x8.astype(jnp.bfloat16), w8)
    assert "16-bit output" in unsupported(x8, w8, out_dtype=jnp.float32)
    assert "128 x 128 block" in unsupported(x8, w8, sw[:1])
    with pytest.raises(ValueError, match="N = 192"):
        block_fp8_matmul_mgpu(x8, sx, w8[:192], sw, interpret=True)


@pytest.mark.parametrize("m", [2048, 64])
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 24576), (12288, 4096), (4096, 4096)])
def test_qwen3_8b_projection_shapes_lower_for_cuda(m, k, n):
    """Qwen3-8B-FP8's projections (qkv 4096 -> 6144, gate+up -> 24576, down 12288 -> 4096,
    o) at B_dense 2048 and a decode batch of 64: Mosaic GPU lowers them and their shared
    memory fits."""
    sd = jax.ShapeDtypeStruct
    exported = jax.export.export(block_fp8_matmul_mgpu, platforms=["cuda"])(
        sd((m, k), FP8), sd((m, k // GROUP), jnp.float32), sd((n, k), FP8),
        sd((n // GROUP, k // GROUP), jnp.float32))
    assert "mosaic_gpu" in exported.mlir_module()
    assert exported.out_avals[0].shape == (m, n) and exported.out_avals[0].dtype == jnp.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [BlockTiling(), BlockTiling(grid_block_n=2)])
def test_block_fp8_matmul_on_gpu(tiling):
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    x8, sx, w8, sw = _operands(2048, 4096, 6144)
    out = np.asarray(block_fp8_matmul_mgpu(x8, sx, w8, sw, tiling=tiling), np.float64)
    ref = np.asarray(block_fp8_matmul_reference(x8, sx, w8, sw), np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 4e-3


def test_the_layer_pads_a_small_batch_to_the_kernels_row_tiles(monkeypatch):
    """fp8_block_linear on a Hopper (faked here: the kernel interpreted): 20 rows padded to
    the 64-row tile with zero rows and unit scales, the output cut back, equal to the
    reference; not the slow dequantized path."""
    import pallas_kernels.block_fp8_matmul_mgpu as kernel_module
    import pallas_kernels.device as device
    import pallas_kernels.mosaic_gpu_support as support
    from nanojax.layers.fp8 import fp8_block_linear, quantize_weight_blocks
    calls = []
    real = kernel_module.block_fp8_matmul_mgpu

    def interpreted(x8, *args, **kw):
        calls.append(x8.shape)
        return real(x8, *args, **{**kw, "interpret": True})
    monkeypatch.setattr(kernel_module, "block_fp8_matmul_mgpu", interpreted)
    monkeypatch.setattr(support, "on_hopper", lambda: True)
    monkeypatch.setattr(device, "device_sms", lambda: 3)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jax.random.normal(jax.random.PRNGKey(1), (20, 256))
    w8, sw = quantize_weight_blocks(jax.random.normal(jax.random.PRNGKey(2), (256, 384)) / 16)
    out = np.asarray(fp8_block_linear(x, w8, sw, jnp.bfloat16), np.float64)
    monkeypatch.undo()
    assert calls == [(64, 256)] and out.shape == (20, 384)
    x8, sx = quantize_groups(x)
    ref = np.asarray(block_fp8_matmul_reference(x8, sx, w8, sw), np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 4e-3
