"""Fused RoPE + KV-cache append: a Pallas kernel and its pure-JAX reference.

Each step writes its new tokens' keys and values into their pages. Unfused that is a RoPE
elementwise pass over k, then two scatters; here one program per token rotates its key
heads and stores key and value rows straight into the page slot (the pages are updated in
place through input/output aliasing). Slots < 0 (padding) are skipped.

Pages are [num_pages, KVH, page_size, D]; RoPE is the rotate-half form (the first and
second halves of D are the pair), as in nanojax/layers/rotary.py.

FP8 pages (float8_e4m3fn with one float32 scale per kv head for k and for v): the kernel
stores x / scale saturated to +-448 (e4m3fn has no inf), as nanojax/layers/kv_fp8.py does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value


def rope_append_reference(k, v, k_pages, v_pages, positions, slot_mapping, inv_freq,
                          k_scale=None, v_scale=None):
    """k, v [T, KVH, D] -> the pages with rotated k and v written at their slots (f32
    rotation; divided by k_scale, v_scale [KVH] and saturated for FP8 pages; stored in the
    pages' dtype); slots < 0 are dropped."""
    angle = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    half = k.shape[-1] // 2
    k1, k2 = k[..., :half].astype(jnp.float32), k[..., half:].astype(jnp.float32)
    k = jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)

    def stored(x, scale, dtype):
        if scale is None:
            return x.astype(dtype)
        x = x.astype(jnp.float32) / scale.astype(jnp.float32)[None, :, None]
        return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(dtype)
    ps = k_pages.shape[2]
    page = jnp.where(slot_mapping >= 0, slot_mapping // ps, k_pages.shape[0])
    off = jnp.maximum(slot_mapping, 0) % ps
    return (k_pages.at[page, :, off].set(stored(k, k_scale, k_pages.dtype), mode="drop"),
            v_pages.at[page, :, off].set(stored(v, v_scale, v_pages.dtype), mode="drop"))


def unsupported(k, k_pages) -> str | None:
    """Why this kernel cannot take these operands, or None when it can. Pallas' Triton
    lowering needs every array value's size a power of 2: a program's [KVH, D/2] halves."""
    kvh, d = k.shape[1:]
    if kvh & (kvh - 1) or d & (d - 1) or d < 2:
        return f"{kvh} kv heads of dim {d}: the Triton lowering needs powers of 2"
    if k_pages.shape[1:2] + k_pages.shape[3:] != (kvh, d):
        return f"pages {k_pages.shape} do not hold keys of {kvh} heads of dim {d}"
    return None


def _kernel(*refs, page_size, scaled):
    if scaled:
        (k_ref, v_ref, pos_ref, slot_ref, freq_ref, ks_ref, vs_ref, kp_in, vp_in, kp_ref,
         vp_ref) = refs
    else:
        k_ref, v_ref, pos_ref, slot_ref, freq_ref, kp_in, vp_in, kp_ref, vp_ref = refs
    del kp_in, vp_in  # the same buffers as kp_ref / vp_ref (aliased)

    def stored(x, scale_ref):  # FP8: x / scale (one per kv head row), saturated
        if not scaled:
            return x.astype(kp_ref.dtype)
        x = x / scale_ref[...][:, None]
        return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(kp_ref.dtype)

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
        kp_ref[page, :, off, :half] = stored(k1 * cos - k2 * sin, ks_ref if scaled else None)
        kp_ref[page, :, off, half:] = stored(k2 * cos + k1 * sin, ks_ref if scaled else None)
        v = v_ref[t]
        vp_ref[page, :, off, :] = stored(v.astype(jnp.float32) if scaled else v,
                                         vs_ref if scaled else None)


def rope_append_impl(k, v, k_pages, v_pages, positions, slot_mapping, inv_freq, *,
                     k_scale=None, v_scale=None, interpret: bool = False):
    """Same result as rope_append_reference; returns the updated (k_pages, v_pages).
    k_scale, v_scale [KVH]: FP8 pages' scales (both or neither)."""
    t = k.shape[0]
    ps = k_pages.shape[2]
    scaled = k_scale is not None
    kern = functools.partial(_kernel, page_size=ps, scaled=scaled)
    scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)) if scaled else ()
    n_in = 5 + len(scales)  # the pages come after the other inputs
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        params["compiler_params"] = plgpu.CompilerParams(num_warps=1, num_stages=1)
    return pl.pallas_call(
        kern, grid=(t,), name="rope_kv_append",
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={n_in: 0, n_in + 1: 1}, interpret=interpret, **params,
    )(k, v, positions.astype(jnp.int32), slot_mapping.astype(jnp.int32),
      jnp.asarray(inv_freq, jnp.float32), *scales, k_pages, v_pages)


rope_append = jax.jit(rope_append_impl, static_argnames=("interpret",),
                      donate_argnums=(2, 3))
