"""Optimal throughput from the GEMM rate measured on this device for the model's own
GEMM shapes at B_dense (NanoFlow: optimal tokens/s = GEMM FLOP/s / (2 x parameters))."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nanojax.profiling.timing import device_seconds
from nanojax.config import ModelConfig


CARD_TFLOPS = 790  # the H200's large-matmul bf16 rate (torch 8192^3, measured on the box)


def optimal_tokens_per_s(cfg: ModelConfig, flops_per_s: float) -> float:
    """NanoFlow's optimal throughput: every token costs 2 x parameters FLOPs."""
    return flops_per_s / (2 * cfg.param_count())


def gemm_shapes(cfg: ModelConfig, b: int) -> dict[str, list[tuple[int, int, int]]]:
    """A layer's GEMMs at b tokens, per op, as the model writes them and as XLA may fuse
    them (q/k/v into one, gate/up into one): the faster form is the op's best rate."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"qkv": [[(b, h, q), (b, h, kv), (b, h, kv)], [(b, h, q + 2 * kv)]],
            "o_proj": [[(b, q, h)]],
            "gate_up": [[(b, h, f), (b, h, f)], [(b, h, 2 * f)]],
            "down": [[(b, f, h)]]}


def _time_gemm(m: int, k: int, n: int, iters: int) -> float:
    """Seconds per bf16 [m, k] x [k, n] product with a bf16 result."""
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(key, (k, n), jnp.bfloat16)
    return device_seconds(jnp.dot, a, w, iters=iters)


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
            "optimal_tokens_per_s": optimal_tokens_per_s(cfg, rate)}
