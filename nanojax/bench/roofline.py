"""Optimal throughput from the GEMM rate measured on this device for the model's own
GEMM shapes at B_dense (NanoFlow: optimal tokens/s = GEMM FLOP/s / (2 x parameters))."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nanojax.config import ModelConfig


def gemm_shapes(cfg: ModelConfig, b: int) -> dict[str, list[tuple[int, int, int]]]:
    """A layer's GEMMs at b tokens, per op, as the model writes them and as XLA may fuse
    them (q/k/v into one, gate/up into one): the faster form is the op's best rate."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"qkv": [[(b, h, q), (b, h, kv), (b, h, kv)], [(b, h, q + 2 * kv)]],
            "o_proj": [[(b, q, h)]],
            "gate_up": [[(b, h, f), (b, h, f)], [(b, h, 2 * f)]],
            "down": [[(b, f, h)]]}


def _time_gemm(m: int, k: int, n: int, iters: int) -> float:
    """Seconds per bf16 [m, k] x [k, n] product, bf16 out, inside one jitted loop. The
    operands pass through an optimization barrier each iteration so that XLA can neither
    hoist the product out of the loop nor shrink it to the part that is used."""
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(key, (k, n), jnp.bfloat16)

    def loop(a, w):
        def body(i, carry):
            a, w, _ = lax.optimization_barrier(carry)
            return a, w, jnp.dot(a, w)
        return lax.fori_loop(0, iters, body, (a, w, jnp.zeros((m, n), jnp.bfloat16)))[2]
    f = jax.jit(loop)
    f(a, w).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        f(a, w).block_until_ready()
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def measure_gemm_rate(cfg: ModelConfig, b_dense: int, iters: int = 20) -> dict:
    """FLOP/s of one layer's GEMMs at B_dense (bf16, random data), each op in its faster
    form, median of 5 repeats; optimal tokens/s = that rate / (2 x parameters)."""
    total_flops, total_t, per = 0, 0.0, []
    for op, forms in gemm_shapes(cfg, b_dense).items():
        best = None
        for form in forms:
            t = sum(_time_gemm(m, k, n, iters) for m, k, n in form)
            flops = sum(2 * m * k * n for m, k, n in form)
            per.append({"op": op, "shapes": form, "seconds": t, "tflops": flops / t / 1e12})
            best = t if best is None else min(best, t)
        total_flops += flops
        total_t += best
    rate = total_flops / total_t
    return {"gemm_flops_per_s": rate, "per_shape": per,
            "optimal_tokens_per_s": rate / (2 * cfg.param_count())}
