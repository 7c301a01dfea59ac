"""The Mosaic GPU paged decode-attention kernel against the shared pure-JAX reference, in
Mosaic GPU's interpret mode on the CPU (TMA copies, barriers and the slot ring simulated;
the matmuls there are jnp.dot, since the interpreter's wgmma takes no transposed operand),
and compiled on a Hopper GPU when there is one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_checks import rel_error
from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu
from pallas_kernels.mosaic_gpu_support import on_hopper

REL_TOL_BF16 = 1e-2  # bf16 inputs and output, f32 accumulation


def _case(seed, b, kvh, g, d, ps, max_pages):
    rng = np.random.default_rng(seed)
    n = b * max_pages + 2
    pt = jnp.asarray(rng.permutation(n)[: b * max_pages].reshape(b, max_pages).astype(np.int32))
    lens = jnp.asarray(rng.integers(1, max_pages * ps + 1, b).astype(np.int32))
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in ((b, kvh * g, d), (n, kvh, ps, d), (n, kvh, ps, d)))
    return q, k, v, pt, lens


@pytest.mark.parametrize("b,kvh,g,d,ps,max_pages,programs,block_k,stages,wgs", [
    (5, 2, 8, 128, 16, 9, 3, 64, 3, 1),  # a full group of 8, units spread unevenly
    (4, 1, 1, 64, 32, 5, 7, 64, 1, 2),   # more workers than units; no pipelining
    (3, 4, 4, 64, 8, 26, 1, 64, 4, 2),   # one program, two workers walk every unit
])
def test_kernel_matches_reference_interpret(b, kvh, g, d, ps, max_pages, programs, block_k,
                                            stages, wgs):
    q, k, v, pt, lens = _case(b + stages, b, kvh, g, d, ps, max_pages)
    out = decode_attention_mgpu(q, k, v, pt, lens, num_programs=programs, block_k=block_k,
                                stages=stages, warpgroups=wgs, interpret=True)
    assert out.shape == q.shape
    assert rel_error(out, q, k, v, pt, lens) < REL_TOL_BF16


def test_shapes_it_cannot_tile_are_refused():
    q, k, v, pt, lens = _case(0, 1, 1, 4, 64, 16, 2)
    with pytest.raises(ValueError, match="block_k 48 must be a multiple of 64"):
        decode_attention_mgpu(q, k, v, pt, lens, block_k=48, interpret=True)
    q, k, v, pt, lens = _case(0, 1, 2, 2, 16, 4, 2)  # the tiny test model's head dim
    with pytest.raises(ValueError, match="multiple of 64"):
        decode_attention_mgpu(q, k, v, pt, lens, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("programs,block_k,stages,wgs", [(66, 64, 4, 1), (132, 128, 2, 1),
                                                        (66, 64, 2, 2)])
def test_kernel_on_gpu(programs, block_k, stages, wgs):
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    q, k, v, pt, lens = _case(1, 64, 8, 4, 128, 16, 64)
    out = decode_attention_mgpu(q, k, v, pt, lens, num_programs=programs, block_k=block_k,
                                stages=stages, warpgroups=wgs)
    assert rel_error(out, q, k, v, pt, lens) < REL_TOL_BF16


SLOW = pytest.mark.slow  # the swap-AB kernel in the interpreter: 25-35 s a case on 2 cores


@pytest.mark.parametrize("kernel,block_q,longest", [
    pytest.param("mosaic", None, False, marks=SLOW), ("mosaic-rows", None, False),
    pytest.param("mosaic", 4, False, marks=SLOW),
    pytest.param("mosaic", 4, True, marks=SLOW)])  # swap-AB workers take the longest first
def test_the_attention_backend_can_route_decode_rows_to_it(kernel, block_q, longest):
    """pallas_backend(decode_kernel="mosaic" (swap-AB) or "mosaic-rows"): a dense batch of
    decodes and a prefill chunk (each token a decode row at its own position; with
    block_q, the chunk in the chunked-prefill kernel's query blocks and the swap-AB kernel
    on the decode rows only) against the pure-JAX backend."""
    from nanojax.config import KernelConfig, named_shape
    from nanojax.errors import ConfigError
    from nanojax.layers.attention import attend_reference, pallas_backend
    from nanojax.layers.rotary import inverse_frequencies
    from nanojax.profiling.synthetic import build_batch

    cfg = named_shape("tiny").replace(head_dim=64)
    rng = np.random.default_rng(0)
    batch = build_batch(cfg, [5, 17, 30], [6], page_size=8, num_pages=64, max_pages=4,
                        rng=rng, prefill_block_q=block_q, prefill_max_seqs=1)
    meta = jax.tree_util.tree_map(jnp.asarray, batch.meta)
    t = len(batch.tokens)
    q = jnp.asarray(rng.standard_normal((t, cfg.num_heads, 64)), jnp.bfloat16)
    kv = tuple(jnp.asarray(rng.standard_normal((64, cfg.num_kv_heads, 8, 64)), jnp.bfloat16)
               for _ in range(2))
    inv = inverse_frequencies(64, cfg.rope_theta)
    backend = pallas_backend(KernelConfig(decode_kernel=kernel, interpret=True,
                                          prefill_block_q=block_q or 16,
                                          decode_longest_first=longest))
    assert (meta.prefill_blocks is not None) == bool(block_q)
    # the order a forward sorts once per step for every layer (None: the kernel sorts)
    meta = backend.prepare(meta)
    assert (meta.decode_order is not None) == longest
    out = backend.attend(q, kv, meta, inv)
    ref = attend_reference(q.astype(jnp.float32), tuple(x.astype(jnp.float32) for x in kv),
                           meta, inv)
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(o).all() and np.linalg.norm(o - r) / np.linalg.norm(r) < REL_TOL_BF16
    with pytest.raises(ConfigError, match="unknown decode kernel"):
        KernelConfig(decode_kernel="cuda")


def test_prepare_sorts_the_decode_rows_once_where_the_swapab_kernel_may_run():
    from nanojax.config import KernelConfig
    from nanojax.layers.attention import PagedMetadata, pallas_backend
    i = jnp.arange(4, dtype=jnp.int32)
    meta = PagedMetadata(positions=jnp.array([3, 9, 0, 5], jnp.int32), slot_mapping=i,
                         seq_ids=i, page_table=i[:, None], context_lens=i,
                         num_decodes=jnp.int32(4))
    order = pallas_backend(KernelConfig()).prepare(meta).decode_order
    np.testing.assert_array_equal(order, [1, 3, 0, 2])  # by position + 1, longest first
    assert pallas_backend(KernelConfig(decode_kernel="triton")).prepare(
        meta).decode_order is None  # Triton's grid takes the rows as they come
    assert pallas_backend(KernelConfig(decode_longest_first=False)).prepare(
        meta).decode_order is None


def test_a_share_is_whole_sms_for_mosaic_and_auto_picks_by_device_and_operands():
    from nanojax.layers.attention import choose_decode_kernel, decode_programs
    assert decode_programs("mosaic", 0.5, 132) == 66  # 66 SMs free for the GEMM
    assert decode_programs("triton", 0.5, 132, ctas_per_sm=4) == 264
    assert decode_programs("mosaic", 1.0, 132) is None and decode_programs("triton", None,
                                                                            132) is None
    q, k, *_ = _case(0, 2, 2, 4, 128, 16, 2)
    assert choose_decode_kernel("auto", q, k) == ("mosaic" if on_hopper() else "triton")
    assert choose_decode_kernel("auto", q.astype(jnp.float32), k) == "triton"  # f32
    assert choose_decode_kernel("triton", q, k) == "triton"
