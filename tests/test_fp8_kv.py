"""The FP8 KV cache (--kv-cache-dtype fp8): the page format, its writers (XLA scatter and the
fused RoPE + append kernel), its readers (reference attention, the Triton decode and
chunked-prefill kernels, in interpret mode and lowered for CUDA), and the engine with it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanojax.errors import ConfigError
from nanojax.layers.kv_fp8 import (FP8, FP8_MAX, QuantizedKV, quantize,
                                   resolve_kv_cache_dtype)
from nanojax.layers.rotary import inverse_frequencies
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.prefill_attention import (prefill_attention, prefill_attention_reference,
                                              query_blocks)
from pallas_kernels.rope_append import rope_append, rope_append_reference

REL_TOL_F32 = 1e-5   # the same FP8 values read in f32: only summation order differs
REL_TOL_BF16 = 2e-2  # bf16 queries: FP8 values are exact in bf16, the query rounds


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "NaN or inf in the kernel output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _fp8_pages(rng, shape, kvh):
    """Random pages already in FP8, with per-head scales spread over two decades."""
    scale = jnp.asarray(10.0 ** rng.uniform(-1.5, 0.5, kvh), jnp.float32)
    x = rng.standard_normal(shape) * np.asarray(scale)[None, :, None, None] * 50
    return quantize(jnp.asarray(x, jnp.float32), scale, head_axis=1), scale


def _dequant(pages, scale):
    return pages.astype(jnp.float32) * scale[None, :, None, None]


def test_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", "bfloat16") == jnp.bfloat16
    assert resolve_kv_cache_dtype("auto", "float32") == jnp.float32
    assert resolve_kv_cache_dtype("bf16", "float32") == jnp.bfloat16
    assert resolve_kv_cache_dtype("fp8", "bfloat16") == FP8
    assert resolve_kv_cache_dtype("fp8_e4m3", "bfloat16") == FP8
    with pytest.raises(ConfigError, match="unknown kv cache dtype 'fp4'"):
        resolve_kv_cache_dtype("fp4", "bfloat16")


def test_quantize_saturates_and_rounds_to_nearest():
    scale = jnp.asarray([1.0, 0.5], jnp.float32)
    x = jnp.asarray([[1000.0, -1000.0, 1.0, 0.3], [300.0, -300.0, 1.0, 0.3]])[None]  # [1,2,4]
    q = quantize(x, scale)
    assert q.dtype == FP8
    back = np.asarray(q.astype(jnp.float32) * scale[None, :, None])
    assert np.isfinite(back).all()  # e4m3fn has no inf: an unclipped overflow is NaN
    np.testing.assert_array_equal(back[0, :, :2], [[FP8_MAX, -FP8_MAX], [224.0, -224.0]])
    # 3 mantissa bits: relative error at most 2^-4 in the normal range
    np.testing.assert_allclose(back[0, :, 2:], np.asarray(x)[0, :, 2:], rtol=2 ** -4)


def test_cache_sizing_counts_the_cache_itemsize():
    from nanojax.config import named_shape
    from nanojax.engine.kv_cache import size_cache
    cfg = named_shape("llama3-8b")  # bf16 weights
    gb = 10 << 30
    bf16 = size_cache(cfg, 16, 2048, 2048, memory_bytes=gb)
    fp8 = size_cache(cfg, 16, 2048, 2048, memory_bytes=gb, kv_itemsize=1)
    assert fp8.num_pages == 2 * bf16.num_pages
    assert cfg.kv_bytes_per_token(1) * 2 == cfg.kv_bytes_per_token() == 131072


def test_fp8_pages_take_triton_unless_swapab_is_named():
    from nanojax.layers.attention import choose_decode_kernel
    q = jnp.zeros((4, 32, 128), jnp.bfloat16)
    for name in ("auto", "mosaic-rows", "triton"):
        assert choose_decode_kernel(name, q, jnp.zeros((8, 8, 16, 128), FP8)) == "triton"
    assert choose_decode_kernel("mosaic", q, jnp.zeros((8, 8, 16, 128), FP8)) == "mosaic"
    # a head dim the swap-AB kernel's 8-bit tiles do not take: Triton
    q64 = jnp.zeros((4, 32, 64), jnp.bfloat16)
    assert choose_decode_kernel("mosaic", q64, jnp.zeros((8, 8, 16, 64), FP8)) == "triton"


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 4), kvh=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]),
       d=st.sampled_from([16, 32]), ps=st.sampled_from([4, 16]),
       max_pages=st.integers(1, 5), programs=st.sampled_from([None, 3]),
       prefetch=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_kernel_reads_fp8_pages_interpret(b, kvh, group, d, ps, max_pages, programs,
                                                 prefetch, seed):
    rng = np.random.default_rng(seed)
    n = b * max_pages + 2
    pt = jnp.asarray(rng.permutation(n)[: b * max_pages].reshape(b, max_pages), jnp.int32)
    lens = jnp.asarray(rng.integers(1, max_pages * ps + 1, b), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, kvh * group, d)), jnp.float32)
    k, ks = _fp8_pages(rng, (n, kvh, ps, d), kvh)
    v, vs = _fp8_pages(rng, (n, kvh, ps, d), kvh)
    with jax.default_matmul_precision("float32"):
        out = decode_attention(q, k, v, pt, lens, k_scale=ks, v_scale=vs,
                               num_programs=programs, prefetch=prefetch, interpret=True)
        ref = decode_attention_reference(q, k, v, pt, lens, ks, vs)
        # the scales mean page * scale: the same as attending over dequantized pages
        plain = decode_attention_reference(q, _dequant(k, ks), _dequant(v, vs), pt, lens)
    assert _rel(out, ref) < REL_TOL_F32
    assert _rel(ref, plain) < REL_TOL_F32


def test_decode_kernel_fp8_pages_bf16_queries_interpret():
    """The GPU's case: bf16 queries, FP8 pages converted to bf16 in the kernel."""
    rng = np.random.default_rng(4)
    b, kvh, g, d, ps, mp = 3, 2, 4, 64, 16, 4
    n = b * mp
    pt = jnp.asarray(rng.permutation(n).reshape(b, mp), jnp.int32)
    lens = jnp.asarray([1, 37, 64], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, kvh * g, d)), jnp.bfloat16)
    k, ks = _fp8_pages(rng, (n, kvh, ps, d), kvh)
    v, vs = _fp8_pages(rng, (n, kvh, ps, d), kvh)
    ref = decode_attention_reference(q.astype(jnp.float32), k, v, pt, lens, ks, vs)
    errs = {}
    for compute in ("float16", "bfloat16"):  # the default widens to f16 (exact for e4m3)
        out = decode_attention(q, k, v, pt, lens, k_scale=ks, v_scale=vs, interpret=True,
                               fp8_compute=compute)
        assert out.dtype == jnp.bfloat16
        errs[compute] = _rel(out, ref)
        assert errs[compute] < REL_TOL_BF16
    assert errs["float16"] <= errs["bfloat16"] * 1.01  # f16 keeps 3 more mantissa bits


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kvh=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]), ps=st.sampled_from([4, 16]),
       chunks=st.lists(st.integers(1, 30), min_size=1, max_size=3),
       block_q=st.sampled_from([4, 16]), seed=st.integers(0, 2**16))
def test_prefill_kernel_reads_fp8_pages_interpret(kvh, group, ps, chunks, block_q, seed):
    rng = np.random.default_rng(seed)
    d = 32
    seqs = [(int(rng.integers(0, 30)), n) for n in chunks]  # (cached prefix, new tokens)
    mp = max(-(-(p + n) // ps) for p, n in seqs)
    num_pages = len(seqs) * mp + 1
    pt = jnp.asarray(rng.permutation(num_pages)[: len(seqs) * mp].reshape(len(seqs), mp),
                     jnp.int32)
    seq_ids = np.concatenate([[r] * n for r, (p, n) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + n) for p, n in seqs]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(seq_ids), kvh * group, d)), jnp.float32)
    k, ks = _fp8_pages(rng, (num_pages, kvh, ps, d), kvh)
    v, vs = _fp8_pages(rng, (num_pages, kvh, ps, d), kvh)
    blocks, slot = query_blocks(seq_ids, positions, block_q)
    with jax.default_matmul_precision("float32"):
        out = prefill_attention(q, k, v, pt, jnp.asarray(positions), jnp.asarray(blocks),
                                jnp.asarray(slot), k_scale=ks, v_scale=vs, block_q=block_q,
                                interpret=True)
        ref = prefill_attention_reference(q, k, v, pt, jnp.asarray(seq_ids),
                                          jnp.asarray(positions), ks, vs)
    assert _rel(out, ref) < REL_TOL_F32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_append_writes_fp8_pages_interpret(dtype):
    rng = np.random.default_rng(7)
    t, kvh, d, ps, num_pages = 40, 2, 32, 4, 12
    slots = rng.permutation(num_pages * ps)[:t].astype(np.int32)
    slots[rng.random(t) < 0.2] = -1  # padding rows write nothing
    k = jnp.asarray(rng.standard_normal((t, kvh, d)) * 3, dtype)
    v = jnp.asarray(rng.standard_normal((t, kvh, d)) * 3, dtype)
    big = int(np.flatnonzero(slots >= 0)[0])
    k = k.at[big, 0, 0].set(5000.0)  # beyond 448 * scale: saturates
    pos = jnp.asarray(rng.integers(0, 4096, t), jnp.int32)
    ks, vs = jnp.asarray([1.0, 0.25], jnp.float32), jnp.asarray([0.5, 2.0], jnp.float32)
    kp0, _ = _fp8_pages(rng, (num_pages, kvh, ps, d), kvh)
    vp0, _ = _fp8_pages(rng, (num_pages, kvh, ps, d), kvh)
    inv_freq = inverse_frequencies(d, 500000.0)
    want = rope_append_reference(k, v, kp0, vp0, pos, jnp.asarray(slots), inv_freq, ks, vs)
    got = rope_append(k, v, kp0, vp0, pos, jnp.asarray(slots), inv_freq, k_scale=ks,
                      v_scale=vs, interpret=True)
    for g, w, s in zip(got, want, (ks, vs)):
        assert g.dtype == FP8
        g, w = np.asarray(_dequant(g, s)), np.asarray(_dequant(w, s))
        assert np.isfinite(g).all()
        # the kernel rotates in f32 as the reference does, up to a few ulps of the angle,
        # but stores straight from f32 where the reference's RoPE rounds to bf16 first: a
        # value near a rounding boundary may land one FP8 step (2^-3 relative) away
        assert np.mean(g == w) > (0.99 if dtype == jnp.float32 else 0.95)
        np.testing.assert_allclose(g, w, rtol=2 ** -3)
    page, off = divmod(int(slots[big]), ps)
    assert abs(float(got[0][page, 0, off].astype(jnp.float32).max())) <= FP8_MAX
    assert np.abs(np.asarray(got[0][page, 0, off].astype(jnp.float32))).max() == FP8_MAX


def _export_cuda(f, *args):
    """Lowers f for CUDA on this (CPU) machine: the Pallas -> Triton lowering of the FP8
    loads, converts and stores runs here."""
    from jax import export
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*sds)


def test_fp8_kernels_lower_for_cuda():
    from pallas_kernels.decode_attention import decode_attention_impl
    from pallas_kernels.prefill_attention import prefill_attention_impl
    from pallas_kernels.rope_append import rope_append_impl
    b, kvh, g, d, ps, n, mp, t = 8, 8, 4, 128, 16, 64, 8, 64
    q = jnp.zeros((b, kvh * g, d), jnp.bfloat16)
    pages = jnp.zeros((n, kvh, ps, d), FP8)
    pt, lens = jnp.zeros((b, mp), jnp.int32), jnp.ones((b,), jnp.int32)
    sc = jnp.ones((kvh,), jnp.float32)
    for f, args in [
        (lambda q, k, v, pt, ln, ks, vs: decode_attention_impl(
            q, k, v, pt, ln, k_scale=ks, v_scale=vs, num_programs=66), (q, pages, pages, pt,
                                                                        lens, sc, sc)),
        (lambda q, k, v, pt, pos, bl, sl, ks, vs: prefill_attention_impl(
            q, k, v, pt, pos, bl, sl, k_scale=ks, v_scale=vs),
         (jnp.zeros((t, kvh * g, d), jnp.bfloat16), pages, pages, pt,
          jnp.zeros((t,), jnp.int32), jnp.zeros((t // 16 + b, 3), jnp.int32),
          jnp.zeros((t,), jnp.int32), sc, sc)),
        (lambda k, v, kp, vp, pos, sl, ks, vs: rope_append_impl(
            k, v, kp, vp, pos, sl, np.ones(d // 2, np.float32), k_scale=ks, v_scale=vs),
         (jnp.zeros((t, kvh, d), jnp.bfloat16), jnp.zeros((t, kvh, d), jnp.bfloat16), pages,
          pages, jnp.zeros((t,), jnp.int32), jnp.zeros((t,), jnp.int32), sc, sc)),
    ]:
        exp = _export_cuda(f, *args)
        assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_engine_fp8_pallas_kernels_match_pure_jax(tiny_bundle):
    """The engine with an FP8 cache: the GPU path's kernels (fused append, decode,
    chunked prefill; interpret mode) give the pure-JAX path's tokens, and the cache is
    FP8 pages with scales."""
    from nanojax.engine.forward import UnrolledForward
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.sampling import SamplingParams
    from nanojax.config import KernelConfig
    from nanojax.layers.attention import paged_attention, pallas_backend

    cfg = tiny_bundle.config
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, cfg.vocab_size, size=int(n)).tolist() for n in (23, 5, 40)]
    outs = []
    kernels = KernelConfig(prefill_kernel=True, prefill_block_q=4, fused_append=True,
                           interpret=True)
    for attention in (paged_attention, pallas_backend(kernels)):
        eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=48, page_size=4,
                                                  max_model_len=64, constant_batch=True,
                                                  kv_cache_dtype="fp8"),
                        forward=UnrolledForward(cfg, attention))
        layer = eng.runner.kv[0]
        assert isinstance(layer, QuantizedKV) and layer.k_pages.dtype == FP8
        assert layer.k_scale.shape == (cfg.num_kv_heads,)
        ids = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        outs.append([done[i].token_ids for i in ids])
        assert eng.allocator.num_free == eng.allocator.num_pages
    assert outs[0] == outs[1]


def test_scan_forward_stacks_fp8_cache(tiny_bundle):
    """The CPU default (layers stacked under lax.scan): FP8 cache with [L, KVH] scales,
    the same tokens as the unrolled layers."""
    from nanojax.engine.forward import ScanForward, UnrolledForward
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.sampling import SamplingParams

    cfg = tiny_bundle.config
    prompts = [[5, 6, 7, 8, 9], [100, 101, 102]]  # one step shape: one compile each
    outs = []
    for fwd in (ScanForward(cfg), UnrolledForward(cfg)):
        eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=32, page_size=4,
                                                  max_model_len=64, kv_cache_dtype="fp8"),
                        forward=fwd)
        ids = [eng.add_request(p, SamplingParams(max_tokens=4, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        outs.append([done[i].token_ids for i in ids])
        if isinstance(fwd, ScanForward):
            assert eng.runner.kv.k_scale.shape == (cfg.num_layers, cfg.num_kv_heads)
            assert eng.runner.kv.k_pages.dtype == FP8
    assert outs[0] == outs[1]


def test_cli_rejects_an_unknown_kv_cache_dtype(capsys):
    from nanojax.cli import build_parser
    p = build_parser()
    args = p.parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    for cmd in (["serve"], ["bench", "throughput"], ["bench", "step", "--plan", "x"]):
        assert p.parse_args(cmd + ["--kv-cache-dtype", "bf16"]).kv_cache_dtype == "bf16"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_bench_step_runs_with_an_fp8_cache(tmp_path):
    """`nanojax bench step --kv-cache-dtype fp8` (the lead's GPU timing run) on the CPU:
    the nano-batch executor carries the FP8 cache through its regions, the modes agree and
    the result records the cache dtype."""
    import json

    from nanojax.cli import main
    from nanojax.config import named_shape
    cfg = named_shape("tiny")
    plan = {"version": 1, "model": cfg.signature(), "tp": 1, "b_dense": 64,
            "nano_batches": {g: [[0, 32], [32, 64]]
                             for g in ("qkv", "attention", "o_proj", "mlp")},
            "nano_ops": [{"op": g, "batch": b, "stream": int(g == "attention")}
                         for b in (0, 1) for g in ("qkv", "attention", "o_proj", "mlp")]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "r.json"
    assert main(["bench", "step", "--model", "random:tiny", "--plan",
                 str(tmp_path / "plan.json"), "--b-dense", "64", "--workloads", "32/32",
                 "--modes", "non-overlap,overlap", "--num-pages", "256",
                 "--max-model-len", "128", "--repeats", "1", "--kv-cache-dtype", "fp8",
                 "--quiet", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["kv_cache_dtype"] == "fp8"
    assert [x["mode"] for x in r["results"]] == ["non-overlap", "overlap"]
    for x in r["results"]:
        assert "error" not in x and x["same_tokens_as_non-overlap"] == 1.0


@pytest.mark.gpu
def test_fp8_kernels_on_gpu():
    """Compiled by Triton: decode and chunked prefill over FP8 pages (bf16 queries), and the
    fused append writing them, against the references."""
    rng = np.random.default_rng(1)
    b, kvh, g, d, ps, mp = 64, 8, 4, 128, 16, 64
    n = b * mp
    pt = jnp.asarray(rng.permutation(n).reshape(b, mp), jnp.int32)
    lens = jnp.asarray(rng.integers(1, mp * ps + 1, b), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, kvh * g, d)), jnp.bfloat16)
    k, ks = _fp8_pages(rng, (n, kvh, ps, d), kvh)
    v, vs = _fp8_pages(rng, (n, kvh, ps, d), kvh)
    ref = decode_attention_reference(q.astype(jnp.float32), k, v, pt, lens, ks, vs)
    for programs in (None, 66):
        out = decode_attention(q, k, v, pt, lens, k_scale=ks, v_scale=vs,
                               num_programs=programs)
        assert _rel(out, ref) < REL_TOL_BF16
    seq_ids = np.repeat(np.arange(4, dtype=np.int32), 300)
    positions = np.tile(np.arange(200, 500, dtype=np.int32), 4)
    blocks, slot = query_blocks(seq_ids, positions, 16)
    qp = jnp.asarray(rng.standard_normal((1200, kvh * g, d)), jnp.bfloat16)
    out = prefill_attention(qp, k, v, pt, jnp.asarray(positions), jnp.asarray(blocks),
                            jnp.asarray(slot), k_scale=ks, v_scale=vs)
    ref = prefill_attention_reference(qp.astype(jnp.float32), k, v, pt,
                                      jnp.asarray(seq_ids), jnp.asarray(positions), ks, vs)
    assert _rel(out, ref) < REL_TOL_BF16
    t = 2048
    kk = jnp.asarray(rng.standard_normal((t, kvh, d)) * 3, jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(n * ps)[:t].astype(np.int32))
    pos = jnp.asarray(rng.integers(0, 4096, t), jnp.int32)
    inv_freq = inverse_frequencies(d, 500000.0)
    want = rope_append_reference(kk, kk, k, v, pos, slots, inv_freq, ks, vs)
    got = rope_append(kk, kk, k, v, pos, slots, inv_freq, k_scale=ks, v_scale=vs)
    for gp, wp, s in zip(got, want, (ks, vs)):
        gp, wp = np.asarray(_dequant(gp, s)), np.asarray(_dequant(wp, s))
        assert np.mean(gp == wp) > 0.95
        np.testing.assert_allclose(gp, wp, rtol=2 ** -3, atol=1e-6)


def test_decode_fp8_query_reaches_the_swapab_kernel():
    """KernelConfig.decode_fp8_query: the Pallas backend's decode on FP8 pages hands the
    swap-AB kernel an e4m3 query (interpret mode): the output moves by the query's
    rounding, no more; bf16 pages ignore the switch."""
    from nanojax.config import KernelConfig
    from nanojax.layers.attention import PagedMetadata, pallas_backend
    b, h, kvh, d, ps, pages_per = 4, 8, 2, 128, 16, 3
    rng = np.random.default_rng(0)
    n = b * pages_per
    kf, vf = (jnp.asarray(rng.standard_normal((n, kvh, ps, d)), jnp.float32) for _ in range(2))
    sc = jnp.ones((kvh,), jnp.float32)
    fp8_layer = QuantizedKV(quantize(kf, sc, head_axis=1), quantize(vf, sc, head_axis=1), sc, sc)
    lens = np.array([40, 17, 48, 3], np.int32)
    meta = PagedMetadata(positions=jnp.asarray(lens - 1), slot_mapping=jnp.full((b,), -1),
                         seq_ids=jnp.arange(b, dtype=jnp.int32),
                         page_table=jnp.arange(n, dtype=jnp.int32).reshape(b, pages_per),
                         context_lens=jnp.asarray(lens), num_decodes=jnp.int32(b))
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    inv_freq = inverse_frequencies(d, 10000.0)
    bf16_layer = (kf.astype(jnp.bfloat16), vf.astype(jnp.bfloat16))
    outs, bf16 = {}, {}
    for fp8_query in (False, True):
        backend = pallas_backend(KernelConfig(decode_kernel="mosaic", interpret=True,
                                              decode_fp8_query=fp8_query,
                                              prefill_kernel=False))
        outs[fp8_query] = np.asarray(backend.attend(q, fp8_layer, meta, inv_freq), np.float32)
        bf16[fp8_query] = np.asarray(backend.attend(q, bf16_layer, meta, inv_freq), np.float32)
    diff = np.linalg.norm(outs[True] - outs[False]) / np.linalg.norm(outs[False])
    assert 1e-4 < diff < 0.1
    np.testing.assert_array_equal(bf16[True], bf16[False])
