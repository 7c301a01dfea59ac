"""What a mixture-of-experts FFN costs beside its active FLOPs: expert GEMMs at nano-batch
sizes and the router's imbalance.

A nano-batch of n tokens sends n*k (token, expert) rows to E experts. Expert e receives
M_e rows, M_e ~ Binomial(n, k * p_e) (p_e: the share of routing decisions expert e gets;
uniform 1/E unless a measured load is given). In the grouped GEMM, expert e costs

    t_e = max(FLOPs(ceil(M_e / tile) * tile rows) / F,  its weights' bytes / BW)  (M_e > 0)

so an expert with few rows is bound by reading its weights (the efficiency loss of small
nano-batches: the ridge is F * bytes / (2 * BW) rows, ~206 on an H200 datasheet), rows
pad to the kernel's M tile, and an uneven router leaves some experts light (below the
ridge) and others heavy: the imbalance costs time through the same max. The expected
time is summed exactly over each expert's binomial distribution.
"""
from __future__ import annotations

import math

import numpy as np

from nanojax.config import ModelConfig

TILE_ROWS = 64  # M of one Hopper warpgroup MMA: the finest row tile a grouped GEMM pads to


def _binomial_pmf(n: int, p: float) -> np.ndarray:
    """P(X = j), j = 0..n, for X ~ Binomial(n, p), in log space (no overflow at n ~ 1e4)."""
    j = np.arange(n + 1)
    if p <= 0:
        return (j == 0).astype(float)
    if p >= 1:
        return (j == n).astype(float)
    lg = np.vectorize(math.lgamma)
    logc = lg(n + 1) - lg(j + 1) - lg(n - j + 1)
    return np.exp(logc + j * math.log(p) + (n - j) * math.log1p(-p))


def expert_loads(cfg: ModelConfig, expert_load=None) -> np.ndarray:
    """p_e k: the probability that a token sends a row to expert e (sums to k)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    share = np.full(e, 1.0 / e) if expert_load is None else np.asarray(expert_load, float)
    if share.shape != (e,) or (share < 0).any() or share.sum() <= 0:
        raise ValueError(f"expert_load must be {e} non-negative shares")
    return np.minimum(share / share.sum() * k, 1.0)


def expert_time(cfg: ModelConfig, n: int, flops: float, bw: float, tp: int = 1,
                bytes_per_param: int = 2, expert_load=None, tile_rows: int = TILE_ROWS) -> dict:
    """Expected seconds of one layer's routed-expert GEMMs on a nano-batch of n tokens
    (per GPU: TP splits every expert's width), with the terms that explain it."""
    h, m = cfg.hidden_size, cfg.moe_intermediate_size
    flops_per_row = 2 * 3 * h * m / tp
    weight_s = 3 * h * m * bytes_per_param / tp / bw
    q = expert_loads(cfg, expert_load)
    total, hit, mean_max = 0.0, 0.0, 0.0
    cdf_max = np.ones(n + 1)
    for qe in q:
        pmf = _binomial_pmf(n, qe)
        rows = np.ceil(np.arange(n + 1) / tile_rows) * tile_rows
        t = np.maximum(rows * flops_per_row / flops, weight_s)
        t[0] = 0.0  # an expert no token chose is skipped
        total += float(pmf @ t)
        hit += 1 - pmf[0]
        cdf_max *= np.cumsum(pmf)
    mean_max = float(np.sum(1 - cdf_max[:-1]))  # E[max_e M_e] = sum_j P(max > j)
    mean_rows = n * cfg.num_experts_per_tok / cfg.num_experts
    ideal = n * cfg.num_experts_per_tok * flops_per_row / flops
    return {"seconds": total, "ideal_seconds": ideal,
            "efficiency": ideal / total if total else 1.0,
            "mean_rows_per_expert": mean_rows, "experts_hit": hit,
            "router_imbalance": mean_max / mean_rows if mean_rows else 1.0,
            "ridge_rows": flops * bytes_per_param / (2 * bw)}


def moe_compute_terms(cfg: ModelConfig, batch: int, nano_batch: int | None, flops: float,
                      bw: float, tp: int = 1, bytes_per_param: int = 2,
                      expert_load=None) -> dict:
    """A dense batch of `batch` tokens cut into nano-batches of `nano_batch` (None: one):
    the expert GEMMs' time over all layers, the ideal (active-FLOP) time, and the bytes of
    the expert weights the batch reads (experts no token chose stay unread)."""
    nb = min(nano_batch or batch, batch)
    sizes = [nb] * (batch // nb) + ([batch % nb] if batch % nb else [])
    per = {n: expert_time(cfg, n, flops, bw, tp, bytes_per_param, expert_load)
           for n in set(sizes)}
    seconds = cfg.num_layers * sum(per[n]["seconds"] for n in sizes)
    ideal = cfg.num_layers * sum(per[n]["ideal_seconds"] for n in sizes)
    full = expert_time(cfg, batch, flops, bw, tp, bytes_per_param, expert_load)
    expert_bytes = (cfg.num_layers * full["experts_hit"] * 3 * cfg.hidden_size
                    * cfg.moe_intermediate_size * bytes_per_param)
    return {"T_experts_s": seconds, "T_experts_ideal_s": ideal,
            "expert_gemm_efficiency": ideal / seconds if seconds else 1.0,
            "nano_batch": nb, "rows_per_expert": per[nb]["mean_rows_per_expert"],
            "router_imbalance": per[nb]["router_imbalance"],
            "experts_hit_per_layer": full["experts_hit"], "expert_weight_bytes": expert_bytes,
            "ridge_rows": per[nb]["ridge_rows"]}
