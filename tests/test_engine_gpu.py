"""On a GPU: the engine's Pallas attention backend against the pure-JAX one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


# decode kernel "auto": f32 gets the Triton kernel, bf16 on Hopper the Mosaic GPU one
# (SmolLM2, head dim 64); the cache is written by the fused append where it takes the kv
# heads (tiny's 2: Triton decode, head dim 16), else by XLA (SmolLM2's 3); the prefill
# chunk goes to the chunked-prefill kernel
@pytest.mark.parametrize("model", ["random:smollm2-135m", "random:tiny"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-2), ("bfloat16", 5e-2)])
def test_pallas_backend_logits_match_pure_jax(model, dtype, tol):
    from checkpoints.loader import load_model
    from nanojax.engine.forward import ScanForward, UnrolledForward
    from nanojax.config import KernelConfig
    from nanojax.layers.attention import PagedMetadata, pallas_backend, prefill_metadata
    # 4 of its 30 layers: each layer's kernels compile separately (~2 s each)
    bundle = load_model(model, dtype=dtype, num_layers=4)
    cfg = bundle.config
    rng = np.random.default_rng(0)
    ps, pages = 16, 64
    # two decodes (contexts 40 and 17, cached earlier) then a 24-token prefill chunk
    lens = [40, 17, 24]
    table = rng.permutation(pages)[:12].reshape(3, 4).astype(np.int32)
    toks, pos, sid = [], [], []
    for s, n in enumerate(lens):
        span = range(n - 1, n) if s < 2 else range(0, n)
        for p in span:
            toks.append(int(rng.integers(0, cfg.vocab_size)))
            pos.append(p)
            sid.append(s)
    pos, sid = np.array(pos, np.int32), np.array(sid, np.int32)
    # the chunk in query blocks for the chunked-prefill kernel (the GPU default; the
    # decode kernel then runs the 2 decode rows only); the pure-JAX backend ignores them
    blocks, slot = prefill_metadata(sid, pos, 2, len(pos), KernelConfig().prefill_block_q, 3)
    meta = PagedMetadata(positions=pos, slot_mapping=(table[sid, pos // ps] * ps + pos % ps),
                         seq_ids=sid, page_table=table, context_lens=np.array(lens, np.int32),
                         num_decodes=np.int32(2), prefill_blocks=blocks, prefill_slot=slot)
    idx = np.array([0, 1, len(toks) - 1], np.int32)
    outs = []
    for fwd in (ScanForward(cfg), UnrolledForward(
            cfg, attention=pallas_backend(KernelConfig(decode_kernel="auto")))):
        params = fwd.prepare(bundle.params)
        kv = fwd.init_kv(pages, ps)
        # fill the cache with a random history first, the same for both
        hist = jax.random.normal(jax.random.PRNGKey(1), (pages, cfg.num_kv_heads, ps,
                                                         cfg.head_dim), dtype)
        if isinstance(kv, tuple):
            kv = (jnp.broadcast_to(hist, kv[0].shape), jnp.broadcast_to(-hist, kv[1].shape))
        else:
            kv = [(hist, -hist) for _ in kv]
        logits, _ = jax.jit(fwd)(params, jnp.asarray(toks, jnp.int32), kv, meta, idx)
        outs.append(np.asarray(logits, np.float32))
    rel = np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[0])
    assert np.isfinite(outs[1]).all() and rel < tol, rel
