"""The CPU's step: the pure-JAX blocked attention against the gather-everything reference,
the per-layer forward against the scan, and the CPU's shape buckets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanojax import SamplingParams
from nanojax.config import EngineConfig
from nanojax.engine.forward import LayerwiseForward, ScanForward, default_forward
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.runner import bucket
from nanojax.layers import attention as A
from nanojax.layers.attention import cpu_blocked

P, KVH, PS, D, H = 64, 2, 4, 8, 4


def _batch(rng, decodes, chunks, num_tokens, width=32):
    """Decode rows (context lengths), then prefill chunks (start, length), then padding,
    each row on pages drawn at random."""
    perm = rng.permutation(P)
    rows = [(c - 1, 1) for c in decodes] + list(chunks)
    table = np.zeros((len(rows), width), np.int32)
    pos, slots, ids, used = [], [], [], 0
    for r, (start, n) in enumerate(rows):
        need = -(-(start + n) // PS)
        pages = perm[used:used + need]
        used += need
        table[r, :need] = pages
        for p in range(start, start + n):
            pos.append(p)
            slots.append(pages[p // PS] * PS + p % PS)
            ids.append(r)
    pad = num_tokens - len(pos)
    meta = A.PagedMetadata(positions=np.array(pos + [0] * pad, np.int32),
                           slot_mapping=np.array(slots + [-1] * pad, np.int32),
                           seq_ids=np.array(ids + [0] * pad, np.int32), page_table=table,
                           context_lens=np.array([s + n for s, n in rows], np.int32),
                           num_decodes=np.int32(len(decodes)))
    return meta, len(pos)


@pytest.mark.parametrize("decodes,chunks,num_tokens,block_q,block_pages", [
    ([5, 9, 30], [], 4, 256, 2),                # decodes only
    ([7] * 9, [], 16, 256, 16),                 # more tokens than fit one gather block
    ([], [(0, 37)], 64, 16, 2),                 # one prompt in query blocks, padding
    ([], [(40, 60)], 64, 16, 4),                # a chunk late in its prompt
    ([3, 17], [(8, 20), (0, 50)], 128, 32, 3),  # decodes beside two chunks
    ([], [(0, 100)], 100, 32, 1),               # tokens not a multiple of the query block
    ([], [(13, 45)], 64, 16, 2),                # one row: unmasked key blocks before each
                                                # query block, a chunk off block borders
])
def test_blocked_attention_matches_reference(decodes, chunks, num_tokens, block_q,
                                             block_pages):
    rng = np.random.default_rng(len(decodes) * 100 + num_tokens)
    kp, vp = (jnp.asarray(rng.standard_normal((P, KVH, PS, D), np.float32))
              for _ in range(2))
    meta, n = _batch(rng, decodes, chunks, num_tokens)
    q = jnp.asarray(rng.standard_normal((num_tokens, H, D), np.float32))
    ref = A.paged_attention_reference(q, kp, vp, meta)[:n]
    modes = [False] if chunks else [True, False]  # per-token reads hold one token a row
    for per_token in modes:
        out = cpu_blocked._blocked_attention(q, kp, vp, meta, per_token=per_token,
                                             block_pages=block_pages, block_q=block_q)
        np.testing.assert_allclose(out[:n], ref, atol=2e-6)
    inv_freq = np.ones(D // 2, np.float32)
    np.testing.assert_allclose(A.attend_cpu(q, (kp, vp), meta, inv_freq)[:n],
                               A.attend_reference(q, (kp, vp), meta, inv_freq)[:n], atol=2e-6)


def test_per_token_blocks_shrink_with_the_batch():
    """A decode iteration gathers at most PER_TOKEN_GATHER_PAGES pages for all its tokens:
    a 256-token step's buffers stay a few MB (one page a token), not 16 pages a token."""
    rng = np.random.default_rng(0)
    kp, vp = (jnp.zeros((P, KVH, PS, D), jnp.float32) for _ in range(2))
    for t, pages in ((1, 16), (256, 1)):
        meta, _ = _batch(rng, [3] * min(t, 8), [], t)
        q = jnp.zeros((t, H, D), jnp.float32)
        hlo = jax.jit(lambda q, m: cpu_blocked._blocked_attention(q, kp, vp, m)).lower(
            q, meta).as_text()
        assert f"tensor<{t}x{pages}x{KVH}x{PS}x{D}xf32>" in hlo, (t, pages)


def test_layerwise_forward_matches_the_scan(tiny_bundle):
    """Same tokens as the scan over a workload of decodes and chunked prefill; each layer
    compiles once per step shape, and its cache pages are donated (updated in place)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(100, 500, size=int(n)).tolist() for n in rng.integers(1, 90, 9)]
    outs, engines = {}, {}
    for fwd in (LayerwiseForward, ScanForward):
        eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=64, num_pages=96, page_size=8,
                                                  max_model_len=128, max_num_seqs=6),
                        forward=fwd(tiny_bundle.config))
        ids = [eng.add_request(p, SamplingParams(max_tokens=12, temperature=0,
                                                 ignore_eos=True)) for p in prompts]
        done = eng.run_to_completion()
        outs[fwd] = [done[i].token_ids for i in ids]
        engines[fwd] = eng
    assert outs[LayerwiseForward] == outs[ScanForward]
    runner = engines[LayerwiseForward].runner
    assert 0 < runner.num_compiles == runner.forward.num_traces
    before = [k.unsafe_buffer_pointer() for k, _ in runner.kv]
    eng = engines[LayerwiseForward]
    eng.add_request(prompts[0][:5], SamplingParams(max_tokens=3, temperature=0))
    eng.run_to_completion()
    assert [k.unsafe_buffer_pointer() for k, _ in runner.kv] == before


def test_cpu_defaults():
    """The CPU runs the per-layer forward, 2,048-token chunks (a default-length prompt in
    one step) padded to multiples of 128 past 128 tokens; tensor-parallel shards of it
    scan (they run traced, in shard_map)."""
    from nanojax.config import named_shape
    cfg = named_shape("tiny", "float32")
    fwd = default_forward(cfg)
    assert isinstance(fwd, LayerwiseForward) and not fwd.traced
    assert isinstance(fwd.for_shard(cfg, "tp"), ScanForward)
    assert EngineConfig().dense_batch(on_gpu=False) == 2048
    # a GPU's: the largest the KV cache keeps full (NanoFlow's rule), at most 2048
    assert EngineConfig().dense_batch(on_gpu=True) == 2048  # cache not sized yet
    gpu = EngineConfig(max_model_len=2048)
    assert gpu.dense_batch(True, kv_tokens=650_512) == 1024  # the 8B's bf16 cache, H200
    assert gpu.dense_batch(True, kv_tokens=650_512, max_model_len=256) == 2048
    assert gpu.dense_batch(True, kv_tokens=2 * 650_512) == 2048  # FP8 pages
    assert gpu.dense_batch(True, kv_tokens=10_000) == 256
    assert EngineConfig(b_dense=64).dense_batch(on_gpu=False) == 64
    assert [bucket(n, 1, 2048, 128) for n in (1, 3, 128, 129, 600, 1000, 1500, 2000)] == [
        1, 4, 128, 256, 640, 1024, 1536, 2048]
    assert [bucket(n, 16, 256) for n in (1, 100, 200)] == [16, 128, 256]  # a GPU's
