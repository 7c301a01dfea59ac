"""The swap-AB Mosaic GPU decode-attention kernel against the pure-JAX reference: Mosaic
GPU's interpreter on the CPU (TMA copies, barriers, the slot ring and the flat pipeline
across items simulated; matmuls and reductions are jnp there), the CUDA lowering at the
benchmark shapes (Mosaic GPU's own checks: shared memory, layouts, WGMMA operands), and
compiled on a Hopper GPU when there is one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_checks import rel_error
from pallas_kernels.decode_attention_swapab import (combine_splits, decode_attention_swapab,
                                                    default_splits, longest_first,
                                                    unsupported)
from pallas_kernels.mosaic_gpu_support import on_hopper

REL_TOL_BF16 = 1e-2  # bf16 inputs and output, f32 accumulation


def _case(seed, b, kvh, g, d, ps, max_pages, full=False, fp8=False):
    """Random pages and lengths (one of 0 when b >= 3); every page no sequence reads
    within its length is NaN, and table entries past a sequence's last page point at
    such pages. fp8: float8_e4m3fn pages and per-kv-head scales (k, v of different
    magnitudes), returned after the lengths."""
    rng = np.random.default_rng(seed)
    n = b * max_pages + 2
    pt = rng.permutation(n)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    lens = (np.full(b, max_pages * ps) if full
            else rng.integers(1, max_pages * ps + 1, b)).astype(np.int32)
    lens[0] = min(max_pages * ps, 64 + 5)  # one context past a block, not a multiple of it
    if b >= 3:
        lens[-1] = 0  # no keys (the engine's prefill rows in a decode call): zeros
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((b, kvh * g, d), (n, kvh, ps, d), (n, kvh, ps, d)))
    used = np.zeros(n, bool)
    for i in range(b):
        used[pt[i, : -(-lens[i] // ps)]] = True
    k[~used], v[~used] = np.nan, np.nan
    poisoned = np.flatnonzero(~used)
    for i in range(b):
        pt[i, -(-lens[i] // ps):] = poisoned[i % len(poisoned)]
    if not fp8:
        return (*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), jnp.asarray(pt),
                jnp.asarray(lens))
    k, v = k * 3.0, v * 0.5
    scales = [np.nanmax(np.abs(x), axis=(0, 2, 3)) / 448 for x in (k, v)]  # e4m3's max
    k8, v8 = (jnp.asarray(x / sc[None, :, None, None], jnp.float8_e4m3fn)
              for x, sc in zip((k, v), scales))
    return (jnp.asarray(q, jnp.bfloat16), k8, v8, jnp.asarray(pt), jnp.asarray(lens),
            *(jnp.asarray(sc, jnp.float32) for sc in scales))


def _dequantized(x8, scale):
    return x8.astype(jnp.float32) * scale[None, :, None, None]


@pytest.mark.parametrize("b,kvh,g,d,ps,max_pages,kw", [
    # GQA 4, two workers in each of two programs stream 6 items through a 2-slot ring
    (3, 2, 4, 64, 16, 7, dict(num_programs=2, warpgroups=2, stages=2)),
    # a group of 8, split-KV (3 key ranges per sequence, combined after the kernel)
    (2, 1, 8, 64, 16, 10, dict(num_programs=3, warpgroups=1, stages=2, splits=3)),
    # no GQA (a group of 1, padded to 16 columns), 8-row pages, a 3-slot ring, one program
    (3, 2, 1, 64, 8, 9, dict(num_programs=1, warpgroups=2, stages=3, columns=16)),
    # float8 pages with per-kv-head scales; a group of 12 (16 columns), 128-key blocks of
    # 32-row pages, D 128
    (2, 2, 12, 128, 32, 5, dict(num_programs=2, warpgroups=1, stages=2, block_k=128,
                                fp8=True)),
])
def test_kernel_matches_reference_interpret(b, kvh, g, d, ps, max_pages, kw):
    fp8 = kw.pop("fp8", False)
    q, k, v, pt, lens, *scales = _case(b + g, b, kvh, g, d, ps, max_pages, fp8=fp8)
    if fp8:
        kw.update(k_scale=scales[0], v_scale=scales[1])
    out = decode_attention_swapab(q, k, v, pt, lens, interpret=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    if fp8:  # against the reference on the dequantized pages
        k, v = _dequantized(k, scales[0]), _dequantized(v, scales[1])
    assert rel_error(out, q, k, v, pt, lens) < REL_TOL_BF16


@pytest.mark.parametrize("num_rows", [0, 4])
def test_rows_past_num_rows_are_skipped_interpret(num_rows):
    """num_rows (traced): rows [0, num_rows) as without it; the rest, whose items are not
    run, leave their output unspecified (here: not what the full call gives, which shows
    they were skipped)."""
    q, k, v, pt, lens = _case(7, 6, 2, 4, 64, 16, 5)
    full = decode_attention_swapab(q, k, v, pt, lens, num_programs=2, warpgroups=2,
                                   interpret=True)
    part = jax.jit(lambda n: decode_attention_swapab(
        q, k, v, pt, lens, num_programs=2, warpgroups=2, num_rows=n, interpret=True))(
        jnp.int32(num_rows))
    np.testing.assert_array_equal(np.asarray(part[:num_rows], np.float32),
                                  np.asarray(full[:num_rows], np.float32))
    rest = np.asarray(part[num_rows:-1], np.float32)  # the last row has no keys: zeros
    assert not np.array_equal(rest, np.asarray(full[num_rows:-1], np.float32))


def test_longest_first_orders_the_live_rows_by_length():
    lens = jnp.array([5, 90, 0, 90, 300, 7, 1000], jnp.int32)
    np.testing.assert_array_equal(longest_first(lens), [6, 4, 1, 3, 5, 0, 2])
    # rows past num_rows (the prefill rows of the engine's decode call) go last
    order = np.asarray(jax.jit(longest_first)(lens, jnp.int32(4)))
    np.testing.assert_array_equal(order[:4], [1, 3, 0, 2])
    assert sorted(order) == list(range(7))


@pytest.mark.parametrize("kw", [dict(num_programs=2, warpgroups=2),  # 12 items, 4 workers
                                dict(num_programs=1, warpgroups=2, splits=2)])
def test_longest_first_gives_the_row_order_result_interpret(kw):
    """Which worker runs an item changes nothing in its arithmetic: the same outputs bit
    for bit, with and without num_rows (so every item ran, once)."""
    q, k, v, pt, lens = _case(11, 6, 2, 4, 64, 16, 6)
    rows = decode_attention_swapab(q, k, v, pt, lens, interpret=True, **kw)
    first = decode_attention_swapab(q, k, v, pt, lens, interpret=True,
                                    longest_first_order=True, **kw)
    np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(rows, np.float32))
    part = jax.jit(lambda n: decode_attention_swapab(
        q, k, v, pt, lens, num_rows=n, longest_first_order=True, interpret=True, **kw))
    for n in (3, 4):  # a last round that ends part-way through the snake, and a full one
        np.testing.assert_array_equal(np.asarray(part(jnp.int32(n))[:n], np.float32),
                                      np.asarray(rows[:n], np.float32))


def test_split_count_and_combine():
    assert default_splits(512, 8, 1024, 132 * 2) == 1  # 4,096 items fill 264 workers
    assert default_splits(16, 8, 4096, 132 * 2) == 2  # 128 items: 2 ranges each
    assert default_splits(16, 8, 4096, 132 * 4) == 4
    assert default_splits(1, 8, 4096, 264) == 16  # 8 items: as many ranges as allowed
    assert default_splits(1, 1, 256, 264) == 1  # 4 blocks: a split needs >= 4
    # splits of one softmax combine to the softmax of all its keys
    rng = np.random.default_rng(0)
    s = rng.standard_normal((1, 1, 3, 8, 40)) * 3  # [B, KVH, S, N, keys]
    vals = rng.standard_normal((1, 1, 3, 40, 16))  # [B, KVH, S, keys, D]
    mx = s.max(-1)
    part = np.einsum("bksnt,bkstd->bksdn", np.exp(s - mx[..., None]), vals)
    l = np.exp(s - mx[..., None]).sum(-1)
    lse = (mx + np.log(l)) / np.log(2)
    valid = np.array([[True, True, False]])  # the third split is empty: ignored
    part[:, :, 2] = np.nan
    out = combine_splits(jnp.asarray(part / l[:, :, :, None, :], jnp.float32),
                         jnp.asarray(lse, jnp.float32), jnp.asarray(valid))
    s2, v2 = s[:, :, :2].transpose(0, 1, 3, 2, 4).reshape(1, 1, 8, 80), vals[:, :, :2].reshape(1, 1, 80, 16)
    p = np.exp(s2 - s2.max(-1, keepdims=True))
    ref = np.einsum("bknt,bktd->bknd", p / p.sum(-1, keepdims=True), v2)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


def test_operands_it_cannot_take_are_refused():
    q, k, v, pt, lens = _case(0, 1, 2, 2, 16, 16, 2)  # the tiny test model's head dim
    assert "multiple of 64" in unsupported(q, k)
    q, k, v, pt, lens = _case(0, 1, 1, 4, 64, 16, 2)
    assert unsupported(q, k) is None
    assert "16-bit" in unsupported(q.astype(jnp.float32), k)
    assert "pages of float32" in unsupported(q, k.astype(jnp.float32))
    assert "multiple of 128" in unsupported(q, k.astype(jnp.float8_e4m3fn))  # D 64
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        decode_attention_swapab(*_case(0, 1, 1, 4, 128, 16, 2, fp8=True)[:5],
                                interpret=True)
    with pytest.raises(ValueError, match="columns 12"):
        decode_attention_swapab(q, k, v, pt, lens, columns=12, interpret=True)
    with pytest.raises(ValueError, match="block_k 96"):
        decode_attention_swapab(q, k, v, pt, lens, block_k=96, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        decode_attention_swapab(*_case(0, 1, 2, 2, 16, 16, 2), interpret=True)


@pytest.mark.parametrize("b,h,kvh,d,rows", [
    (2048, 32, 8, 128, True),   # LLaMA-3-8B at B_dense 2048: 65,536 rows of q
    (26, 9, 3, 64, False),      # SmolLM2: 234 rows, not a multiple of the TMA's 8-row tile
    (3, 16, 2, 64, True),       # a group of 8: no padding columns either way
])
def test_the_query_goes_as_rows_where_the_tma_takes_them(b, h, kvh, d, rows):
    """q as [B x H, D] rows (no padded copy) where B x H is a multiple of 8; else padded
    per group to [B, KVH, columns, D] (jax 0.11.2's TMA refused 234 rows on the H200)."""
    from pallas_kernels.decode_attention_swapab import swapab_call
    sd = jax.ShapeDtypeStruct
    pages = sd((64, kvh, 16, d), jnp.bfloat16)
    q = jax.eval_shape(lambda *a: swapab_call(*a, num_programs=8).operands[0],
                       sd((b, h, d), jnp.bfloat16), pages, pages, sd((b, 4), jnp.int32),
                       sd((b,), jnp.int32))
    cols = -(-(h // kvh) // 8) * 8
    assert q.shape == ((b * h, d) if rows else (b, kvh, cols, d))


@pytest.mark.parametrize("b,kvh,g,kw", [
    (3, 2, 4, dict(num_programs=2, warpgroups=2, stages=2)),  # query rows straight from q
    (2, 2, 12, dict(num_programs=1, warpgroups=1, stages=3, block_k=128)),  # padded groups
    (3, 1, 8, dict(num_programs=2, warpgroups=1, splits=2)),  # split-KV
    # longest first (the engine's default): the items in another order than q's rows
    (4, 2, 4, dict(num_programs=2, warpgroups=1, stages=2, longest_first_order=True)),
])
def test_fp8_query_matches_the_reference_on_its_quantized_query_interpret(b, kvh, g, kw):
    """fp8_query: S^T = K Q^T with the query in e4m3 too (one scale per sequence and kv
    head). Exact against the reference fed the same quantized query; against the bf16
    query it is off by the query's rounding only."""
    from pallas_kernels.decode_attention_swapab import quantize_query_groups
    ps = 32 if kw.get("block_k") == 128 else 16
    q, k, v, pt, lens, ks, vs = _case(b * g, b, kvh, g, 128, ps, 6, fp8=True)
    out = decode_attention_swapab(q, k, v, pt, lens, k_scale=ks, v_scale=vs,
                                  fp8_query=True, interpret=True, **kw)
    q8, sq = quantize_query_groups(q, kvh)
    assert q8.dtype == jnp.float8_e4m3fn and sq.shape == (b, kvh)
    qd = (q8.astype(jnp.float32).reshape(b, kvh, g, 128) * sq[:, :, None, None]).reshape(q.shape)
    kd, vd = _dequantized(k, ks), _dequantized(v, vs)
    assert rel_error(out, qd.astype(jnp.bfloat16), kd, vd, pt, lens) < REL_TOL_BF16
    assert rel_error(out, q, kd, vd, pt, lens) < 0.1  # e4m3's 3 mantissa bits on q
    with pytest.raises(ValueError, match="float8 pages only"):
        decode_attention_swapab(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), pt, lens,
                                fp8_query=True, interpret=True)


@pytest.mark.parametrize("b,ctx,programs,page_dtype", [
    (512, 1024, 44, "bf16"), (512, 1024, 66, "bf16"), (512, 1024, 132, "bf16"),
    (16, 4096, 132, "bf16"),  # few sequences: the split-KV path
    (1024, 4096, 132, "bf16"),  # a large batch (16 GiB of pages)
    (512, 1024, 66, "fp8"), (16, 4096, 132, "fp8"),  # float8 pages, both paths
    (2048, 512, 132, "fp8:longest"), (16, 4096, 66, "bf16:longest"),  # longest first
    (512, 1024, 132, "fp8:fp8q"), (16, 4096, 132, "fp8:fp8q"),  # FP8 QK^T, both paths
])
def test_benchmark_shapes_lower_for_cuda(b, ctx, programs, page_dtype):
    """LLaMA-3-8B attention (32/8 heads, D 128, bf16 query, pages of 16): the CUDA
    lowering runs Mosaic GPU's checks (shared memory per block, layouts, WGMMA operands)
    on the CPU; the engine's row count (num_rows) is traced."""
    sd = jax.ShapeDtypeStruct
    n = b * ctx // 16
    page_dtype, _, option = page_dtype.partition(":")
    order, fp8q = option == "longest", option == "fp8q"
    pages = jnp.bfloat16 if page_dtype == "bf16" else jnp.float8_e4m3fn
    scales = {} if page_dtype == "bf16" else dict(k_scale=jnp.ones(8), v_scale=jnp.ones(8))
    f = jax.jit(lambda *a: decode_attention_swapab(*a[:5], num_programs=programs,
                                                   num_rows=a[5], **scales,
                                                   longest_first_order=order,
                                                   fp8_query=fp8q))
    exported = jax.export.export(f, platforms=["cuda"])(
        sd((b, 32, 128), jnp.bfloat16), sd((n, 8, 16, 128), pages),
        sd((n, 8, 16, 128), pages), sd((b, ctx // 16), jnp.int32), sd((b,), jnp.int32),
        sd((), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("programs,kw", [(44, {}), (132, dict(warpgroups=3, stages=2)),
                                         (66, dict(splits=4)), (66, dict(fp8=True)),
                                         (132, dict(fp8=True, fp8_query=True))])
def test_kernel_on_gpu(programs, kw):
    if not on_hopper():
        pytest.skip("Mosaic GPU needs a Hopper (sm_90) or newer GPU")
    fp8 = kw.pop("fp8", False)
    q, k, v, pt, lens, *scales = _case(1, 64, 8, 4, 128, 16, 64, fp8=fp8)
    if fp8:
        kw.update(k_scale=scales[0], v_scale=scales[1])
    out = decode_attention_swapab(q, k, v, pt, lens, num_programs=programs, **kw)
    if kw.get("fp8_query"):  # against the query the kernel was given: its e4m3 rounding
        from pallas_kernels.decode_attention_swapab import quantize_query_groups
        q8, sq = quantize_query_groups(q, 8)
        q = (q8.astype(jnp.float32).reshape(64, 8, 4, 128)
             * sq[:, :, None, None]).reshape(q.shape).astype(jnp.bfloat16)
    if fp8:
        k, v = _dequantized(k, scales[0]), _dequantized(v, scales[1])
    assert rel_error(out, q, k, v, pt, lens) < REL_TOL_BF16


def test_longest_first_in_a_snake_evens_the_workers_on_a_trace():
    """The count behind longest_first's docstring: key blocks per worker (528: 132
    programs x 4) on the 8B step's lmsys batch at B_dense 2048, the items dealt as the
    kernel deals them: round-robin in row order, or longest first in a snake."""
    from nanojax.config import named_shape
    from nanojax.profiling.synthetic import engine_batch_rows, synthetic_batch, workload_lengths
    lengths = workload_lengths("lmsys", 2048)
    batch = synthetic_batch(named_shape("llama3-8b"), 2048, lengths, 16, 131071, 128, (1024,),
                            prefill_block_q=16, prefill_max_seqs=64,
                            rows=engine_batch_rows({"lmsys": lengths}, 2048, (1024,)))
    ctx = np.asarray(batch.meta.positions)[:batch.num_decodes] + 1
    workers, kvh = 528, 8

    def busiest(seq_order, snake):  # the busiest worker's key blocks over the mean
        blocks = np.repeat(np.maximum(1, -(-ctx[seq_order] // 64)), kvh)
        rnd, pos = np.divmod(np.arange(len(blocks)), workers)
        if snake:
            pos = np.where(rnd % 2 == 0, pos, workers - 1 - pos)
        per = np.bincount(pos, blocks, minlength=workers)
        return per.max() / per.mean()
    order = np.asarray(longest_first(jnp.asarray(ctx, jnp.int32)))
    assert busiest(np.arange(len(ctx)), False) > 1.4 and busiest(order, True) < 1.15
