"""The pure-JAX references: softmax attention over a contiguous cache (one sequence) and
over the paged cache (every token's whole context gathered), which the blocked CPU
attention and the Pallas kernels are checked against."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nanojax.layers.attention.metadata import ContiguousMetadata, PagedMetadata
from nanojax.layers.kv_fp8 import kv_parts
from nanojax.layers.rotary import apply_rope

NEG_INF = -1e30


def _softmax_attend(q, keys, values, mask, k_scale=None, v_scale=None):
    """q [T, H, D]; keys/values [T, L, KVH, D] (per-token key set); mask [T, L].
    k_scale, v_scale [KVH]: FP8 pages' scales (the k scale multiplies the scores, the v
    scale the output)."""
    t, h, d = q.shape
    kvh = keys.shape[2]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32) * (d ** -0.5)
    if k_scale is not None:
        qg = qg * k_scale[None, :, None, None]
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, keys.astype(jnp.float32))
    scores = jnp.where(mask[:, None, None, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, values.astype(jnp.float32))
    if v_scale is not None:
        out = out * v_scale[None, :, None, None]
    return out.reshape(t, h, d).astype(q.dtype)


def init_contiguous_cache(cfg, max_len: int, dtype):
    shape = (max_len, cfg.num_kv_heads, cfg.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def contiguous_attention(q, k, v, kv_layer, meta: ContiguousMetadata, inv_freq):
    q = apply_rope(q, meta.positions, inv_freq)
    k = apply_rope(k, meta.positions, inv_freq)
    k_cache, v_cache = kv_layer
    k_cache = k_cache.at[meta.positions].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[meta.positions].set(v.astype(v_cache.dtype))
    max_len = k_cache.shape[0]
    mask = jnp.arange(max_len)[None, :] <= meta.positions[:, None]
    t = q.shape[0]
    keys = jnp.broadcast_to(k_cache[None], (t,) + k_cache.shape)
    values = jnp.broadcast_to(v_cache[None], (t,) + v_cache.shape)
    return _softmax_attend(q, keys, values, mask), (k_cache, v_cache)


def gather_sequence_kv(pages, page_table_rows):
    """pages [N, KVH, ps, D], rows [T, P] -> [T, P * ps, KVH, D] in position order."""
    g = pages[page_table_rows]  # [T, P, KVH, ps, D]
    t, p, kvh, ps, d = g.shape
    return g.transpose(0, 1, 3, 2, 4).reshape(t, p * ps, kvh, d)


def paged_attention_reference(q, k_pages, v_pages, meta: PagedMetadata, k_scale=None,
                              v_scale=None):
    """Each token attends to its own sequence's cached keys up to its position (causal)."""
    rows = meta.page_table[meta.seq_ids]
    keys = gather_sequence_kv(k_pages, rows)
    values = gather_sequence_kv(v_pages, rows)
    key_pos = jnp.arange(keys.shape[1])
    mask = key_pos[None, :] <= meta.positions[:, None]
    return _softmax_attend(q, keys, values, mask, k_scale, v_scale)


def attend_reference(q, kv_layer, meta: PagedMetadata, inv_freq):
    """Pure-JAX attention over pages that already hold this step's keys (CPU path)."""
    q = apply_rope(q, meta.positions, inv_freq)
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    return paged_attention_reference(q, k_pages, v_pages, meta, ks, vs)
