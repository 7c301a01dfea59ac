"""The KV cache's element type, and the FP8 (e4m3) page format (vLLM's --kv-cache-dtype fp8).

A 16-bit (or float32) cache layer is the plain pair (k_pages, v_pages). An FP8 layer is a
`QuantizedKV`: pages of the same shape [num_pages, KVH, page_size, D] in float8_e4m3fn plus
one float32 scale per kv head for k and one for v ([KVH] per layer, [L, KVH] stacked).
The stored value is x / scale, saturated to e4m3's +-448 (e4m3fn has no inf: an unclipped
overflow would become NaN); x is read back as page * scale. Attention never dequantizes a
page: the k scale multiplies the scores and the v scale the output (one multiply per row).

Scales: static 1.0, vLLM's default without calibration. e4m3's relative precision is the
same everywhere in its normal range [2^-6, 448], so a scale only matters for values outside
it; SmolLM2's keys and values stay inside it (measured absmax in
bench/results/fp8_kv_quality_cpu.json). Calibrating from the first prefill would make every
later request's numerics depend on which request came first, and later, larger values would
saturate. Scales are data in the cache pytree, so calibrated ones (e.g. from a checkpoint's
k_scale/v_scale) can be put there; they must never change once pages hold values written
with them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nanojax.config import KV_CACHE_DTYPES as CONFIG_KV_CACHE_DTYPES
from nanojax.errors import ConfigError

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # the largest finite e4m3fn value

# --kv-cache-dtype names -> element type ("auto": the model's dtype)
_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8": "float8_e4m3fn",
          "fp8_e4m3": "float8_e4m3fn", "float32": "float32", "fp32": "float32"}
KV_CACHE_DTYPES = ("auto", *_NAMES)
assert KV_CACHE_DTYPES == CONFIG_KV_CACHE_DTYPES  # one list of names for the flag and this map


def resolve_kv_cache_dtype(name: str, model_dtype: str) -> jnp.dtype:
    """The cache's element type for a --kv-cache-dtype name; ConfigError names a bad one."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in _NAMES:
        raise ConfigError(f"unknown kv cache dtype {name!r}; known: "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(_NAMES[name])


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == FP8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKV:
    """One layer's FP8 cache (or all layers', stacked on a leading axis)."""

    k_pages: jax.Array  # [..., num_pages, KVH, page_size, D] float8_e4m3fn
    v_pages: jax.Array
    k_scale: jax.Array  # [..., KVH] float32
    v_scale: jax.Array


def init_kv_layer(shape: tuple, dtype, make=None):
    """Zeroed pages of `shape` (leading axes, then [num_pages, KVH, page_size, D]) and
    dtype; FP8 gets scales of 1.0. make(fn) builds the arrays (e.g. a jit with shardings)."""
    dtype = jnp.dtype(dtype)
    make = make or (lambda fn: jax.jit(fn)())
    if not is_fp8(dtype):
        return make(lambda: jnp.zeros(shape, dtype)), make(lambda: jnp.zeros(shape, dtype))
    scale_shape = shape[:-4] + shape[-3:-2]
    return QuantizedKV(make(lambda: jnp.zeros(shape, FP8)), make(lambda: jnp.zeros(shape, FP8)),
                       jnp.ones(scale_shape, jnp.float32), jnp.ones(scale_shape, jnp.float32))


def kv_parts(kv_layer):
    """(k_pages, v_pages, k_scale, v_scale); the scales are None for an unquantized layer."""
    if isinstance(kv_layer, QuantizedKV):
        return kv_layer.k_pages, kv_layer.v_pages, kv_layer.k_scale, kv_layer.v_scale
    k_pages, v_pages = kv_layer
    return k_pages, v_pages, None, None


def with_pages(kv_layer, k_pages, v_pages):
    """The same layer (same scales) holding new pages."""
    if isinstance(kv_layer, QuantizedKV):
        return dataclasses.replace(kv_layer, k_pages=k_pages, v_pages=v_pages)
    return k_pages, v_pages


def quantize(x, scale, head_axis: int = -2):
    """x / scale (scale [KVH] along head_axis), saturated, as e4m3."""
    shape = [1] * x.ndim
    shape[head_axis] = -1
    y = x.astype(jnp.float32) / scale.reshape(shape)
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8)
