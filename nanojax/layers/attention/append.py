"""The KV append every backend runs before it attends: RoPE on the step's keys, then keys
and values written into their pages (quantized where the pages are FP8, layers/kv_fp8.py),
in pure JAX or as the fused Pallas kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nanojax.layers.attention.metadata import PagedMetadata
from nanojax.layers.kv_fp8 import kv_parts, quantize, with_pages
from nanojax.layers.rotary import apply_rope


def write_kv_pages(k_pages, v_pages, k, v, slot_mapping, k_scale=None, v_scale=None):
    """Scatter k, v [T, KVH, D] into their pages; slots < 0 are dropped. With scales
    (FP8 pages) the stored values are x / scale, saturated (layers/kv_fp8.py)."""
    num_pages, _, page_size, _ = k_pages.shape
    if k_scale is not None:
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    # lax.div/rem rather than // and %: jnp's versions are nested jits, which XLA refuses
    # inside stream-annotated regions; slots are non-negative where they are used
    page = jnp.where(slot_mapping >= 0, jax.lax.div(slot_mapping, page_size), num_pages)
    off = jax.lax.rem(jnp.maximum(slot_mapping, 0), page_size)
    k_pages = k_pages.at[page, :, off].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, :, off].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


def append_kv(k, v, kv_layer, meta: PagedMetadata, inv_freq):
    """RoPE on the new keys, then write k and v into their pages (the step's KV append)."""
    k = apply_rope(k, meta.positions, inv_freq)
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    return with_pages(kv_layer, *write_kv_pages(k_pages, v_pages, k, v, meta.slot_mapping,
                                                 ks, vs))


def append_kv_pallas(k, v, kv_layer, meta: PagedMetadata, inv_freq, interpret=False):
    """The same append as one Pallas kernel (pallas_kernels/rope_append.py), where the
    kernel takes the shapes (else append_kv: e.g. SmolLM2's 3 kv heads)."""
    from pallas_kernels.rope_append import rope_append_impl, unsupported
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    if unsupported(k, k_pages) is not None:
        return append_kv(k, v, kv_layer, meta, inv_freq)
    return with_pages(kv_layer, *rope_append_impl(
        k, v, k_pages, v_pages, meta.positions, meta.slot_mapping, inv_freq,
        k_scale=ks, v_scale=vs, interpret=interpret))
