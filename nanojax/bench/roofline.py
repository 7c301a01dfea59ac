"""Optimal throughput from the GEMM rate measured on this device for the model's own
GEMM shapes at B_dense (NanoFlow: optimal tokens/s = GEMM FLOP/s / (2 x parameters))."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nanojax.config import ModelConfig


def gemm_shapes(cfg: ModelConfig, b: int) -> list[tuple[int, int, int]]:
    h, f = cfg.hidden_size, cfg.intermediate_size
    return [(b, h, cfg.q_size), (b, h, cfg.kv_size), (b, h, cfg.kv_size),
            (b, cfg.q_size, h), (b, h, f), (b, h, f), (b, f, h)]


def measure_gemm_rate(cfg: ModelConfig, b_dense: int, iters: int = 20) -> dict:
    """FLOP/s of one layer's GEMMs at B_dense (bf16, random data), median of 5 repeats."""
    total_flops, total_t, per = 0, 0.0, []
    key = jax.random.PRNGKey(0)
    for m, k, n in gemm_shapes(cfg, b_dense):
        a = jax.random.normal(key, (m, k), jnp.bfloat16)
        w = jax.random.normal(key, (k, n), jnp.bfloat16)

        def loop(a, w):
            def body(i, acc):
                return acc + jnp.dot(a + acc[0, 0].astype(a.dtype) * 0, w,
                                     preferred_element_type=jnp.float32)[:1, :1]
            return lax.fori_loop(0, iters, body, jnp.zeros((1, 1), jnp.float32))
        f = jax.jit(loop)
        f(a, w).block_until_ready()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            f(a, w).block_until_ready()
            ts.append((time.perf_counter() - t) / iters)
        t = float(np.median(ts))
        per.append({"m": m, "k": k, "n": n, "seconds": t, "tflops": 2 * m * k * n / t / 1e12})
        total_flops += 2 * m * k * n
        total_t += t
    rate = total_flops / total_t
    return {"gemm_flops_per_s": rate, "per_shape": per,
            "optimal_tokens_per_s": rate / (2 * cfg.param_count())}
