"""Optimal throughput from the GEMM rate measured on this device for the model's own
GEMM shapes at B_dense (NanoFlow: optimal tokens/s = GEMM FLOP/s / (2 x parameters)).
For a mixture of experts the parameters are the active ones (a token's top-k experts),
and the expert GEMMs are measured at their rows per expert, B_dense * k / E."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nanojax.profiling.timing import device_seconds
from nanojax.config import ModelConfig


CARD_TFLOPS = 790  # the H200's large-matmul bf16 rate (torch 8192^3, measured on the box)


def optimal_tokens_per_s(cfg: ModelConfig, flops_per_s: float) -> float:
    """NanoFlow's optimal throughput: every token costs 2 x parameters FLOPs."""
    return flops_per_s / (2 * cfg.active_param_count())


def gemm_shapes(cfg: ModelConfig, b: int) -> dict[str, list[tuple[int, int, int]]]:
    """A layer's GEMMs at b tokens, per op, as the model writes them and as XLA may fuse
    them (q/k/v into one, gate/up into one): the faster form is the op's best rate."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {"qkv": [[(b, h, q), (b, h, kv), (b, h, kv)], [(b, h, q + 2 * kv)]],
              "o_proj": [[(b, q, h)]],
              "gate_up": [[(b, h, f), (b, h, f)], [(b, h, 2 * f)]],
              "down": [[(b, f, h)]]}
    if cfg.is_moe:  # every expert's GEMMs at the mean rows per expert; router; shared expert
        e, m = cfg.num_experts, cfg.moe_intermediate_size
        r = max(1, round(b * cfg.num_experts_per_tok / e))
        shapes["gate_up"] = [[(r, h, m)] * 2 * e, [(r, h, 2 * m)] * e]
        shapes["down"] = [[(r, m, h)] * e]
        shapes["router"] = [[(b, h, e)]]
        if cfg.shared_expert_intermediate_size:
            s = cfg.shared_expert_intermediate_size
            shapes["shared"] = [[(b, h, s), (b, h, s), (b, s, h)], [(b, h, 2 * s), (b, s, h)]]
    return shapes


def _time_gemm(m: int, k: int, n: int, iters: int) -> float:
    """Seconds per bf16 [m, k] x [k, n] product with a bf16 result."""
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(key, (k, n), jnp.bfloat16)
    return device_seconds(jnp.dot, a, w, iters=iters)


def measure_gemm_rate(cfg: ModelConfig, b_dense: int, iters: int = 20) -> dict:
    """FLOP/s of one layer's GEMMs at B_dense (bf16, random data), each op in its faster
    form, median of 5 repeats; optimal tokens/s = that rate / (2 x parameters)."""
    total_flops, total_t, per, timed = 0, 0.0, [], {}
    for op, forms in gemm_shapes(cfg, b_dense).items():
        best = None
        for form in forms:
            for shape in form:  # an MoE form repeats one shape per expert: time it once
                if shape not in timed:
                    timed[shape] = _time_gemm(*shape, iters)
            t = sum(timed[shape] for shape in form)
            flops = sum(2 * m * k * n for m, k, n in form)
            per.append({"op": op, "shapes": form, "seconds": t, "tflops": flops / t / 1e12})
            best = t if best is None else min(best, t)
        total_flops += flops
        total_t += best
    rate = total_flops / total_t
    return {"gemm_flops_per_s": rate, "per_shape": per,
            "optimal_tokens_per_s": optimal_tokens_per_s(cfg, rate)}
