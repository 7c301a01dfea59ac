"""The bounded-grid Mosaic GPU matmul against its f32 reference: Mosaic GPU's interpret
mode on the CPU (more output tiles than programs, so programs loop), its lowering for
CUDA at the LLaMA-3-8B nano-batch shapes (shared memory is checked there), and compiled
on a Hopper GPU when there is one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul_mgpu import matmul_mgpu, matmul_reference, unsupported
from pallas_kernels.mosaic_gpu_support import on_hopper

REL_TOL_BF16 = 1e-2


def _rel(out, a, b):
    r = np.asarray(matmul_reference(a, b), np.float64)
    o = np.asarray(out, np.float64)
    assert np.isfinite(o).all()
    return np.linalg.norm(o - r) / np.linalg.norm(r)


def _operands(m, k, n, seed=0):
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(ka, (m, k), jnp.bfloat16),
            jax.random.normal(kb, (k, n), jnp.bfloat16))


@pytest.mark.parametrize("m,k,n,programs", [(256, 128, 256, 3), (128, 192, 512, 1)])
def test_matmul_matches_reference_interpret(m, k, n, programs):
    a, b = _operands(m, k, n)
    out = matmul_mgpu(a, b, num_programs=programs, interpret=True)
    assert out.shape == (m, n) and out.dtype == a.dtype
    assert _rel(out, a, b) < REL_TOL_BF16


def test_shapes_it_cannot_tile_are_refused():
    a, b = _operands(128, 64, 256)
    assert unsupported(a, b) is None
    assert "multiple of the 256 tile" in unsupported(*_operands(128, 64, 384))
    assert "multiple of the 128 tile" in unsupported(*_operands(100, 64, 256))
    with pytest.raises(ValueError, match="two or more output tiles"):  # not a crash
        matmul_mgpu(a, b, interpret=True)
    assert "16-bit" in unsupported(a.astype(jnp.float32), b.astype(jnp.float32))
    with pytest.raises(ValueError, match="K = 100"):
        matmul_mgpu(*_operands(128, 100, 256), interpret=True)


@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_llama3_8b_nano_batch_shapes_lower_for_cuda(k, n):
    """qkv, gate_up and down of a 1,024-token nano-batch, on half the SMs: the CUDA
    lowering runs Mosaic GPU's own checks (shared memory, layouts) without a GPU."""
    sd = jax.ShapeDtypeStruct
    f = jax.jit(lambda a, b: matmul_mgpu(a, b, num_programs=66))
    exported = jax.export.export(f, platforms=["cuda"])(sd((1024, k), jnp.bfloat16),
                                                        sd((k, n), jnp.bfloat16))
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [132, 66, 33])
def test_matmul_on_gpu(programs):
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    a, b = _operands(1024, 4096, 4096)
    assert _rel(matmul_mgpu(a, b, num_programs=programs), a, b) < REL_TOL_BF16


def test_a_gemm_share_is_a_bounded_matmul_only_where_enabled_and_tileable():
    from nanojax.layers.matmul import matmul_at
    assert matmul_at(1.0, 4, enabled=True, interpret=True) is None  # a whole GPU: XLA's dot
    assert matmul_at(0.5, 4, enabled=False, interpret=True) is None
    # compiled (not interpreted) only where Mosaic GPU runs
    assert (matmul_at(0.5, 4, enabled=True) is None) == (not on_hopper())
    mm = matmul_at(0.5, num_sms=4, enabled=True, interpret=True)
    a, b = _operands(256, 64, 256)
    assert _rel(mm(a, b), a, b) < REL_TOL_BF16
    a, b = _operands(96, 64, 256)  # 96 rows: not tileable, so XLA's dot, bit for bit
    np.testing.assert_array_equal(np.asarray(mm(a, b)), np.asarray(jnp.dot(a, b)))


def test_every_projection_of_a_layer_goes_through_its_matmul():
    from nanojax.config import named_shape
    from nanojax.models.llama import DecoderLayer
    cfg = named_shape("tiny")
    calls = []

    def spy(x, w):
        calls.append(w.shape)
        return jnp.dot(x, w)
    x = jax.random.normal(jax.random.PRNGKey(0), (5, cfg.hidden_size), jnp.float32)
    params = DecoderLayer(cfg).init(jax.random.PRNGKey(1), x, method=DecoderLayer.mlp)
    params = {"params": {**params["params"], **DecoderLayer(cfg).init(
        jax.random.PRNGKey(2), x, method=DecoderLayer.qkv)["params"]}}
    for method in (DecoderLayer.qkv, DecoderLayer.mlp):
        want = DecoderLayer(cfg).apply(params, x, method=method)
        got = DecoderLayer(cfg, matmul=spy).apply(params, x, method=method)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len(calls) == 6  # q, k, v, then gate, up, down
