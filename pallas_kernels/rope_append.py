"""Fused RoPE + KV-cache append: a Pallas kernel and its pure-JAX reference.

Each step writes its new tokens' keys and values into their pages. Unfused that is a RoPE
elementwise pass over k, then two scatters; here one program per token rotates its key
heads and stores key and value rows straight into the page slot (the pages are updated in
place through input/output aliasing). Slots < 0 (padding) are skipped.

Pages are [num_pages, KVH, page_size, D]; RoPE is the rotate-half form (the first and
second halves of D are the pair), as in nanojax/layers/rotary.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def rope_append_reference(k, v, k_pages, v_pages, positions, slot_mapping, inv_freq):
    """k, v [T, KVH, D] -> the pages with rotated k and v written at their slots (f32
    rotation, stored in the pages' dtype); slots < 0 are dropped."""
    angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    half = k.shape[-1] // 2
    k1, k2 = k[..., :half].astype(jnp.float32), k[..., half:].astype(jnp.float32)
    k = jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)
    ps = k_pages.shape[2]
    page = jnp.where(slot_mapping >= 0, slot_mapping // ps, k_pages.shape[0])
    off = jnp.maximum(slot_mapping, 0) % ps
    return (k_pages.at[page, :, off].set(k.astype(k_pages.dtype), mode="drop"),
            v_pages.at[page, :, off].set(v.astype(v_pages.dtype), mode="drop"))


def _kernel(k_ref, v_ref, pos_ref, slot_ref, freq_ref, kp_in, vp_in, kp_ref, vp_ref, *,
            page_size):
    del kp_in, vp_in  # the same buffers as kp_ref / vp_ref (aliased)
    t = pl.program_id(0)
    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _():
        page, off = lax.div(slot, page_size), lax.rem(slot, page_size)
        half = freq_ref.shape[0]
        angle = pos_ref[t].astype(jnp.float32) * freq_ref[...]     # [D/2]
        cos, sin = jnp.cos(angle)[None, :], jnp.sin(angle)[None, :]
        # the halves are read and written through the refs: Triton lowers no value slice
        # or concatenate
        k1 = k_ref[t, :, :half].astype(jnp.float32)                  # [KVH, D/2]
        k2 = k_ref[t, :, half:].astype(jnp.float32)
        kp_ref[page, :, off, :half] = (k1 * cos - k2 * sin).astype(kp_ref.dtype)
        kp_ref[page, :, off, half:] = (k2 * cos + k1 * sin).astype(kp_ref.dtype)
        vp_ref[page, :, off, :] = v_ref[t].astype(vp_ref.dtype)


def rope_append_impl(k, v, k_pages, v_pages, positions, slot_mapping, inv_freq, *,
                     interpret: bool = False):
    """Same result as rope_append_reference; returns the updated (k_pages, v_pages)."""
    t = k.shape[0]
    ps = k_pages.shape[2]
    kern = functools.partial(_kernel, page_size=ps)
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=1, num_stages=1)
    return pl.pallas_call(
        kern, grid=(t,), name="rope_kv_append",
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={5: 0, 6: 1}, interpret=interpret, **params,
    )(k, v, positions.astype(jnp.int32), slot_mapping.astype(jnp.int32),
      jnp.asarray(inv_freq, jnp.float32), k_pages, v_pages)


rope_append = jax.jit(rope_append_impl, static_argnames=("interpret",),
                      donate_argnums=(2, 3))
