"""The chunked-prefill Pallas kernel against its pure-JAX reference (interpret mode on the
CPU; compiled on a GPU when there is one)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pallas_kernels.prefill_attention import (prefill_attention, prefill_attention_reference,
                                              query_blocks)

REL_TOL_F32 = 1e-5   # f32 in interpret mode: only the summation order differs
REL_TOL_BF16 = 1e-2  # bf16 on the GPU, f32 accumulation


def _batch(rng, kvh, group, d, ps, chunks, decodes, dtype):
    """Decode tokens, then prefill chunks each after a cached prefix, pages shuffled; pages
    nobody reads are poisoned with NaN."""
    seqs = [(int(rng.integers(1, 60)), 1) for _ in range(decodes)]
    seqs += [(int(rng.integers(0, 40)), n) for n in chunks]  # (prefix, new tokens)
    max_pages = max(-(-(p + n) // ps) for p, n in seqs)
    num_pages = len(seqs) * max_pages + 2
    perm = rng.permutation(num_pages)
    page_table = perm[: len(seqs) * max_pages].reshape(len(seqs), max_pages).astype(np.int32)
    seq_ids, positions = [], []
    for row, (p, n) in enumerate(seqs):
        seq_ids += [row] * n
        positions += list(range(p, p + n))
    k = rng.standard_normal((num_pages, kvh, ps, d))
    v = rng.standard_normal((num_pages, kvh, ps, d))
    used = np.zeros(num_pages, bool)
    for row, (p, n) in enumerate(seqs):
        used[page_table[row, : -(-(p + n) // ps)]] = True
    k[~used], v[~used] = np.nan, np.nan
    q = rng.standard_normal((len(seq_ids), kvh * group, d))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(page_table),
            np.asarray(seq_ids, np.int32), np.asarray(positions, np.int32))


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "NaN or inf in the kernel output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def test_query_blocks_cover_every_token_once():
    seq_ids = np.array([0, 1, 2, 2, 2, 2, 2, 3, 3, 3])
    positions = np.array([9, 4, 0, 1, 2, 3, 4, 7, 8, 9])
    blocks, slot = query_blocks(seq_ids, positions, block_q=2)
    used = blocks[blocks[:, 1] > 0]
    assert used.tolist() == [[0, 1, 0], [1, 1, 1], [2, 2, 2], [4, 2, 2], [6, 1, 2],
                             [7, 2, 3], [9, 1, 3]]
    assert sorted(slot.tolist()) == sorted(set(slot.tolist()))  # no two tokens share a slot
    with pytest.raises(ValueError, match="too few"):
        query_blocks(seq_ids, positions, block_q=2, max_blocks=3)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kvh=st.sampled_from([1, 2]), group=st.sampled_from([1, 3, 4]),
       d=st.sampled_from([16, 32]), ps=st.sampled_from([4, 16]),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       decodes=st.integers(0, 3), block_q=st.sampled_from([1, 4, 16]),
       programs=st.sampled_from([None, 3]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference_interpret(kvh, group, d, ps, chunks, decodes, block_q,
                                            programs, seed):
    rng = np.random.default_rng(seed)
    q, k, v, pt, seq_ids, positions = _batch(rng, kvh, group, d, ps, chunks, decodes,
                                             jnp.float32)
    blocks, slot = query_blocks(seq_ids, positions, block_q)
    with jax.default_matmul_precision("float32"):
        out = prefill_attention(q, k, v, pt, jnp.asarray(positions), jnp.asarray(blocks),
                                jnp.asarray(slot), block_q=block_q, num_programs=programs,
                                interpret=True)
        ref = prefill_attention_reference(q, jnp.nan_to_num(k), jnp.nan_to_num(v), pt,
                                          jnp.asarray(seq_ids), jnp.asarray(positions))
    assert out.shape == ref.shape
    assert _rel(out, ref) < REL_TOL_F32


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kvh=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 4]),
       block_q=st.sampled_from([4, 8, 16]), fp8=st.booleans(),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       decodes=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_in_place_writes_the_prefill_rows_and_keeps_the_others(kvh, group, block_q, fp8,
                                                               chunks, decodes, seed):
    """out=: the queries read where they lie, the prefill rows written into out (the
    decode kernel's output in the engine), every other row left as it was; blocks of the
    engine's layout (prefill_metadata: after the decodes, spare blocks empty). FP8 pages
    with their scales too."""
    from nanojax.layers.attention.metadata import prefill_metadata
    from pallas_kernels.prefill_attention import in_place_unsupported
    assume(in_place_unsupported(kvh * group, kvh, block_q) is None)  # 16 rows or more
    rng = np.random.default_rng(seed)
    q, k, v, pt, seq_ids, positions = _batch(rng, kvh, group, 16, 4, chunks, decodes,
                                             jnp.float32)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    scales = {}
    if fp8:
        scales = dict(k_scale=jnp.full((kvh,), 4.5 / 448, jnp.float32),
                      v_scale=jnp.full((kvh,), 5.0 / 448, jnp.float32))
        k = (k / scales["k_scale"][None, :, None, None]).astype(jnp.float8_e4m3fn)
        v = (v / scales["v_scale"][None, :, None, None]).astype(jnp.float8_e4m3fn)
    t = len(seq_ids) + 5  # and 5 padding tokens, neither decode nor prefill
    seq_ids, positions = np.pad(seq_ids, (0, 5)), np.pad(positions, (0, 5))
    q = jnp.pad(q, ((0, 5), (0, 0), (0, 0)))
    blocks, slot = prefill_metadata(seq_ids, positions, decodes, t - 5, block_q, 3)
    out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    with jax.default_matmul_precision("float32"):
        res = prefill_attention(q, k, v, pt, jnp.asarray(positions), jnp.asarray(blocks),
                                jnp.asarray(slot), block_q=block_q, interpret=True,
                                out=out, **scales)
        ref = prefill_attention_reference(q, k, v, pt, jnp.asarray(seq_ids),
                                          jnp.asarray(positions), **scales)
    kept = np.r_[0:decodes, t - 5:t]
    np.testing.assert_array_equal(np.asarray(res)[kept], np.asarray(out)[kept])
    assert _rel(res[decodes:t - 5], ref[decodes:t - 5]) < REL_TOL_F32


@pytest.mark.parametrize("heads,kvh,d", [(32, 8, 128), (9, 3, 64), (14, 2, 64), (48, 2, 64)])
def test_both_kernels_lower_for_cuda_with_any_query_group(heads, kvh, d):
    """Groups of 3 (SmolLM2), 7 (Qwen2-0.5B) and 24 heads: the query rows a program holds
    are padded to a power of 2 (Pallas' Triton lowering takes no other array sizes; 3 x 16
    = 48 rows failed before). Lowered for CUDA here, on the CPU."""
    from jax import export
    from pallas_kernels.decode_attention import decode_attention_impl
    sd, t, nb, bf = jax.ShapeDtypeStruct, 64, 8, jnp.bfloat16
    pages = sd((32, kvh, 16, d), bf)
    triton = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    export.export(jax.jit(lambda q, kp, vp, pt, pos, bl, sl: prefill_attention(
        q, kp, vp, pt, pos, bl, sl, block_q=16)), platforms=["cuda"], disabled_checks=triton)(
        sd((t, heads, d), bf), pages, pages, sd((4, 8), jnp.int32), sd((t,), jnp.int32),
        sd((nb, 3), jnp.int32), sd((t,), jnp.int32))
    export.export(jax.jit(decode_attention_impl), platforms=["cuda"], disabled_checks=triton)(
        sd((t, heads, d), bf), pages, pages, sd((t, 8), jnp.int32), sd((t,), jnp.int32))


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_in_place_kernel_lowers_for_cuda(kv_dtype):
    """The in-place prefill (LLaMA's 32 heads on 8: 16 tokens x 4 = 64 rows) lowered for
    CUDA on the CPU: its masked 3-D loads and stores and the reshapes into rows."""
    from jax import export
    sd, t, nb, bf = jax.ShapeDtypeStruct, 64, 8, jnp.bfloat16
    pages = sd((32, 8, 16, 128), kv_dtype)
    scales = {}
    if kv_dtype != jnp.bfloat16:
        scales = dict(k_scale=jnp.ones((8,), jnp.float32), v_scale=jnp.ones((8,), jnp.float32))
    text = export.export(jax.jit(lambda q, kp, vp, pt, pos, bl, sl, out: prefill_attention(
        q, kp, vp, pt, pos, bl, sl, block_q=16, out=out, **scales)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        sd((t, 32, 128), bf), pages, pages, sd((4, 8), jnp.int32), sd((t,), jnp.int32),
        sd((nb, 3), jnp.int32), sd((t,), jnp.int32), sd((t, 32, 128), bf)).mlir_module()
    assert "xla.gpu.triton" in text


@pytest.mark.gpu
def test_kernel_on_gpu_bf16():
    rng = np.random.default_rng(1)
    q, k, v, pt, seq_ids, positions = _batch(rng, 8, 4, 128, 16, [512, 300, 37], 64,
                                             jnp.bfloat16)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    blocks, slot = query_blocks(seq_ids, positions, 16)
    out = prefill_attention(q, k, v, pt, jnp.asarray(positions), jnp.asarray(blocks),
                            jnp.asarray(slot))
    ref = prefill_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), pt,
                                      jnp.asarray(seq_ids), jnp.asarray(positions))
    assert _rel(out, ref) < REL_TOL_BF16
    # in place, into a buffer whose first 64 rows (the decodes') stay
    from nanojax.layers.attention.metadata import prefill_metadata
    blocks, slot = prefill_metadata(seq_ids, positions, 64, len(seq_ids), 16, 3)
    buf = jnp.full(q.shape, 3.0, q.dtype)
    res = prefill_attention(q, k, v, pt, jnp.asarray(positions), jnp.asarray(blocks),
                            jnp.asarray(slot), out=buf)
    assert (np.asarray(res[:64], np.float32) == 3.0).all()
    assert _rel(res[64:], ref[64:]) < REL_TOL_BF16


@pytest.mark.parametrize("pipeline,block_q", [(False, 4), (True, 4), (True, 8)])
def test_engine_with_the_pallas_kernels_matches_pure_jax(tiny_bundle, pipeline, block_q):
    """The GPU attention path (decode, chunked-prefill and fused RoPE + append kernels, in
    interpret mode) inside the engine: chunked prefills, decodes, and the nano-batch
    executor's slices. Query blocks of 4 tokens x 2 heads take the gather into blocks, of
    8 the in-place prefill (16 rows)."""
    from nanojax.engine.forward import UnrolledForward
    from nanojax.config import EngineConfig, KernelConfig
    from nanojax.engine.llm_engine import LLMEngine
    from nanojax.engine.sampling import SamplingParams
    from nanojax.layers.attention import paged_attention, pallas_backend
    from nanojax.pipeline.executor import PipelineForward

    cfg = tiny_bundle.config
    plan = {"version": 1, "model": cfg.signature(), "tp": 1, "b_dense": 32,
            "nano_batches": {g: [[0, 12], [12, 32]]
                             for g in ("qkv", "attention", "o_proj", "mlp")},
            "nano_ops": [{"op": "qkv", "batch": 0}, {"op": "qkv", "batch": 1},
                         {"op": "attention", "batch": 1, "stream": 1},
                         {"op": "attention", "batch": 0, "stream": 1},
                         {"op": "o_proj", "batch": 1}, {"op": "mlp", "batch": 1},
                         {"op": "o_proj", "batch": 0}, {"op": "mlp", "batch": 0}]}
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, cfg.vocab_size, size=int(n)).tolist() for n in (23, 5, 40)]
    outs = []
    for attention in (paged_attention, pallas_backend(KernelConfig(
            prefill_kernel=True, prefill_block_q=block_q, prefill_max_seqs=1, fused_append=True,
            interpret=True))):  # one prefilling sequence an iteration: the cap binds
        fwd = (PipelineForward(cfg, plan, "overlap", attention=attention) if pipeline
               else UnrolledForward(cfg, attention))
        eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=48, page_size=4,
                                                  max_model_len=64, constant_batch=True),
                        forward=fwd)
        ids = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        outs.append([done[i].token_ids for i in ids])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen2-57b-a14b", "llama3-8b"])
@pytest.mark.parametrize("decode_kernel,kv_dtype", [("mosaic", None), ("triton", None),
                                                     ("auto", jnp.float8_e4m3fn)])
def test_the_gpu_step_lowers_for_cuda_for_odd_query_groups(shape, decode_kernel, kv_dtype):
    """One layer of the engine's GPU forward with every Pallas kernel on (decode, chunked
    prefill, the fused append by default) lowered for CUDA on the CPU, for shapes whose
    query groups are not powers of 2 (SmolLM2: 3 kv heads of 3; Qwen2-MoE: 4 of 7): the
    Triton lowering's size rules surfaced only on the GPU before (bench/results/log/step.md).
    bf16 and FP8 pages. LLaMA's group of 4 takes the in-place prefill."""
    from jax import export
    from nanojax.config import KernelConfig, named_shape
    from nanojax.engine.forward import UnrolledForward
    from nanojax.layers.attention import PagedMetadata, pallas_backend
    from nanojax.models import param_shapes
    from pallas_kernels.prefill_attention import in_place_unsupported
    cfg = named_shape(shape, "bfloat16").replace(num_layers=1, vocab_size=512)
    fwd = UnrolledForward(cfg, attention=pallas_backend(KernelConfig(
        decode_kernel=decode_kernel, prefill_kernel=True)))
    fwd.grouped_gemm = "xla"  # Qwen2-MoE's experts: no Mosaic GPU call but the decode's
    sd, t, pages, width, block_q, seqs = jax.ShapeDtypeStruct, 64, 64, 8, 16, 8
    i32 = sd((t,), jnp.int32)
    nb = t // block_q + seqs
    meta = PagedMetadata(i32, i32, i32, sd((seqs, width), jnp.int32), sd((seqs,), jnp.int32),
                         sd((), jnp.int32), sd((nb, 3), jnp.int32), i32)
    kv = jax.eval_shape(lambda: fwd.init_kv(pages, 16, kv_dtype))
    params = jax.tree_util.tree_map(lambda a: sd(a.shape, a.dtype), param_shapes(cfg))
    text = export.export(jax.jit(fwd.__call__), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        params, i32, kv, meta, sd((seqs,), jnp.int32)).mlir_module()
    # the fused append where its kernel takes the heads: Qwen2-MoE's 4 and LLaMA's 8,
    # not SmolLM2's 3
    assert ("rope_kv_append" in text) == (cfg.num_kv_heads in (4, 8))
    # the calls that write into an input: the append's pages, the in-place prefill's
    # output (LLaMA's 16 tokens x 4 heads; not groups of 3 or 7)
    in_place = in_place_unsupported(cfg.num_heads, cfg.num_kv_heads, block_q) is None
    assert in_place == (shape == "llama3-8b")
    assert text.count("output_operand_aliases") == ("rope_kv_append" in text) + in_place
    assert ("mosaic_gpu" in text) == (decode_kernel == "mosaic")  # FP8 pages: Triton
