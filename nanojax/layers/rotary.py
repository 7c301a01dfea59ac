"""Rotary position embedding (rotate-half convention, as HF LLaMA), with Llama-3 scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """The per-pair rotation frequencies; Llama-3 scaling stretches the low frequencies."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    if "freq_factors" in scaling:  # GGUF stores Llama-3 scaling as per-pair divisors
        return (inv / np.asarray(scaling["freq_factors"], np.float64)).astype(np.float32)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_mid, mid, scaled).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """x: [T, heads, head_dim]; positions: [T]. Computed in f32, returned in x's dtype."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
