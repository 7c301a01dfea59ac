"""The fused GEMM + decode-attention Mosaic GPU kernel (one launch split by program id)
against its references: Mosaic GPU's interpreter on the CPU at tiny shapes with the GEMM
on 1 of 2 and 2 of 3 programs, the CUDA lowering at the LLaMA-3-8B nano-batch shapes for
G in {66, 88, 110} of 132 (Mosaic GPU's layout and operand checks, without a GPU; shared
memory is counted by hand in the module), and compiled on a Hopper GPU when there is
one."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_checks import rel_error
from pallas_kernels.fused_gemm_attention_mgpu import (SMEM_BYTES, fused_gemm_attention,
                                                      fused_reference, gemm_config, gemm_part,
                                                      gemm_smem_bytes, unsupported,
                                                      wave_fill)
from pallas_kernels.matmul_mgpu import matmul_reference
from pallas_kernels.mosaic_gpu_support import on_hopper
from test_decode_attention_swapab import _case

REL_TOL_BF16 = 1e-2


def _gemm_operands(m, k, n, seed=0):
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(ka, (m, k), jnp.bfloat16),
            jax.random.normal(kb, (k, n), jnp.bfloat16))


def _gemm_rel(c, a, b):
    r = np.asarray(matmul_reference(a, b), np.float64)
    o = np.asarray(c, np.float64)
    assert np.isfinite(o).all()
    return np.linalg.norm(o - r) / np.linalg.norm(r)


@pytest.mark.parametrize("gemm_programs,num_programs,mkn,batch,max_pages,splits", [
    # 1 GEMM program loops over 2 output tiles; 1 attention program's 3 workers take 4
    # (sequence, kv head) items (one worker streams two)
    (1, 2, (128, 64, 512), 2, 3, None),
    # 2 GEMM programs share 3 tiles; 1 attention program, 3 sequences (one with no keys)
    # of one kv head split in 2 key ranges: the kernel's second output (log-sum-exps) and
    # the combine after it. ~40 s in the interpreter (9 threads), so marked slow
    pytest.param(2, 3, (384, 64, 256), 3, 3, 2, marks=pytest.mark.slow),
])
def test_fused_matches_reference_interpret(gemm_programs, num_programs, mkn, batch,
                                           max_pages, splits):
    a, b = _gemm_operands(*mkn)
    q, k, v, pt, lens = _case(batch, batch, 1 if splits else 2, 4, 64, 16, max_pages)
    c, o = fused_gemm_attention(a, b, q, k, v, pt, lens, gemm_programs=gemm_programs,
                                num_programs=num_programs, splits=splits, interpret=True)
    assert c.shape == (mkn[0], mkn[2]) and c.dtype == a.dtype
    assert o.shape == q.shape and o.dtype == q.dtype
    assert _gemm_rel(c, a, b) < REL_TOL_BF16
    assert rel_error(o, q, k, v, pt, lens) < REL_TOL_BF16


def test_reference_is_the_pair_in_f32():
    a, b = _gemm_operands(128, 64, 256)
    q, k, v, pt, lens = _case(1, 2, 2, 4, 64, 16, 3)
    c, o = fused_reference(a, b, q, k, v, pt, lens)
    assert c.dtype == o.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(c), np.asarray(a, np.float32) @ np.asarray(
        b, np.float32), rtol=1e-5, atol=1e-3)
    assert rel_error(o, q, k, v, pt, lens) < 1e-6


def test_what_it_cannot_take_is_refused():
    a, b = _gemm_operands(128, 64, 256)
    q, k, *_ = _case(1, 2, 2, 4, 64, 16, 3)
    ok = dict(gemm_programs=1, num_programs=3)
    assert unsupported(a, b, q, k, **ok) is None
    assert "GEMM" in unsupported(*_gemm_operands(100, 64, 256), q, k, **ok)
    assert "attention" in unsupported(a, b, q.astype(jnp.float32), k, **ok)
    for g in (0, 3):  # both sides need programs
        assert "0 < G < 3" in unsupported(a, b, q, k, gemm_programs=g, num_programs=3)
    assert gemm_smem_bytes(jnp.bfloat16) <= SMEM_BYTES  # the default tiles fit a block
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    big = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=5)
    assert "shared memory" in unsupported(a, b, q, k, config=big, **ok)
    with pytest.raises(ValueError, match="0 < G"):
        fused_gemm_attention(a, b, q, k, k, *_case(1, 2, 2, 4, 64, 16, 3)[3:],
                             gemm_programs=3, num_programs=3, interpret=True)


def _nano_batch_args(k, n, tokens=1024, batch=512, ctx=1024, kvh=8, group=4, d=128, ps=16):
    sd = jax.ShapeDtypeStruct
    pages = batch * ctx // ps + 2
    return (sd((tokens, k), jnp.bfloat16), sd((k, n), jnp.bfloat16),
            sd((batch, kvh * group, d), jnp.bfloat16),
            sd((pages, kvh, ps, d), jnp.bfloat16), sd((pages, kvh, ps, d), jnp.bfloat16),
            sd((batch, ctx // ps), jnp.int32), sd((batch,), jnp.int32))


@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_llama3_8b_nano_batch_pairs_lower_for_cuda(k, n):
    """qkv, gate_up and down of a 1,024-token nano-batch beside the decode attention of
    512 sequences of 1,024 tokens (32/8 heads, D 128, pages of 16), the GEMM on 66, 88 or
    110 of 132 programs."""
    for g in (66, 88, 110):
        f = jax.jit(lambda *x, g=g: fused_gemm_attention(*x, gemm_programs=g,
                                                         num_programs=132))
        exported = jax.export.export(f, platforms=["cuda"])(*_nano_batch_args(k, n))
        assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("m,n,programs,small", [
    (1024, 6144, 132, True),    # qkv: 192 large tiles fill 73% of 2 waves; small 97%
    (1024, 6144, 88, True),     # 73% against 87%
    (1024, 6144, 66, False),    # 97%: the large tiles
    (1024, 28672, 132, False),  # gate_up, o, down fill their waves with large tiles
    (1024, 4096, 132, False), (512, 6144, 132, False),
    (1024, 6272, 132, True)])   # N a multiple of 128, not of 256: only small tiles fit
def test_gemm_tiles_follow_the_wave_fill(m, n, programs, small):
    """gemm_config takes 128 x 128 tiles only where 128 x 256 leave the last wave mostly
    empty and the small ones fill it better (bench/kernels/gemm_tiles.py measured why)."""
    cfg = gemm_config(m, n, programs)
    assert (cfg.tile_n == 64) is small
    assert wave_fill(1024, 6144, 256, 132) == pytest.approx(192 / 264)  # qkv: 1.45 waves
    assert wave_fill(1024, 6144, 256, 0) == wave_fill(1000, 6144, 256, 132) == 0.0
    assert gemm_smem_bytes(jnp.bfloat16, cfg) <= SMEM_BYTES


def test_gemm_part_alone_lowers_for_cuda():
    """The GEMM body alone on the full grid (what the benchmark sets beside XLA's GEMM)."""
    f = jax.jit(lambda a, b: gemm_part(a, b, num_programs=132))
    assert "mosaic_gpu" in jax.export.export(f, platforms=["cuda"])(
        *_nano_batch_args(4096, 6144)[:2]).mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,g", [(4096, 6144, 66), (4096, 6144, 88), (14336, 4096, 110)])
def test_fused_on_gpu(k, n, g):  # qkv at G 88 and its GEMM part alone: 128 x 128 tiles
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    a, b = _gemm_operands(1024, k, n)
    q, kp, vp, pt, lens = _case(3, 64, 8, 4, 128, 16, 40)
    c, o = fused_gemm_attention(a, b, q, kp, vp, pt, lens, gemm_programs=g)
    assert _gemm_rel(c, a, b) < REL_TOL_BF16
    assert rel_error(o, q, kp, vp, pt, lens) < REL_TOL_BF16
    assert _gemm_rel(gemm_part(a, b), a, b) < REL_TOL_BF16


def test_the_executors_fused_pair_lowers_for_cuda():
    """The executor's call path (nanojax/pipeline/fused.py): the Pallas attend path (RoPE,
    page-table rows) with the fused launch in place of its decode kernel, beside q_proj of
    a 1,024-token nano-batch, G 88 of 132, at the 8B decode shapes."""
    from nanojax.config import KernelConfig
    from nanojax.layers.attention import PagedMetadata, pallas_backend
    from nanojax.pipeline.fused import PairMatmul
    backend = pallas_backend(KernelConfig(decode_kernel="mosaic"))
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    x, w, q, kp, vp, pt, lens = _nano_batch_args(4096, 4096)
    t = q.shape[0]
    i32 = jax.ShapeDtypeStruct((t,), jnp.int32)
    made = {}

    def f(x, w, q, kp, vp, pt, lens, positions, slots, seq_ids, num_decodes):
        meta = PagedMetadata(positions, slots, seq_ids, pt, lens, num_decodes)
        mm = PairMatmul(backend.attend_with, q, (kp, vp), meta, inv_freq,
                        gemm_programs=88, programs=132)
        c = mm(x, w)
        made["why"] = mm.why
        return c, mm.attention_out
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        x, w, q, kp, vp, pt, lens, i32, i32, i32, jax.ShapeDtypeStruct((), jnp.int32))
    assert made["why"] is None
    text = exported.mlir_module()  # one Mosaic GPU launch: the pair, no separate decode
    assert len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text)) == 1
    assert [o.shape for o in exported.out_avals] == [(1024, 4096), q.shape]
