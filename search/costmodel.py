"""NanoFlow's cost model: is a (GPU, model, workload, batch, TP) point compute-, memory- or
network-bound, and what throughput is optimal.

Per iteration of a dense batch of B tokens on TP GPUs (each holding 1/TP of the weights):
    T_compute = 2 * P * B / (TP * FLOPs)
    T_mem     = (weight bytes + KV bytes read by the batch's decodes) / (TP * BW)
    T_net     = 2 all-reduces per layer of B x hidden activations, ring cost 2(TP-1)/TP
    optimal tokens/s/GPU = FLOPs / (2 * P)
Decodes are the share d / (p + d) of the batch's tokens (p, d: mean prompt and output
lengths), each reading the KV cache of a context of p + d / 2 tokens on average.

Mixture of experts (Mixtral, Qwen2-MoE): P above is the active parameter count (a token
computes with its top-k experts only), so optimal = FLOPs / (2 * active params). The
routed experts' share of T_compute is their grouped GEMMs' expected time on the
iteration's nano-batches (search/moe_cost.py: rows per expert at that nano-batch size,
weight-read bound below the ridge, tile padding, the router's imbalance), and T_mem
reads only the experts some token chose.
"""
from __future__ import annotations

import dataclasses

from nanojax.config import ModelConfig, named_shape
from nanojax.errors import NanojaxError


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    tflops: float          # dense bf16/fp16 tensor-core TFLOP/s
    mem_bw_tbps: float     # HBM TB/s
    mem_gb: float
    net_gbps: float        # per-GPU NVLink bandwidth, GB/s (one direction)
    source: str


# Vendor datasheets (SXM parts); "measured" rows come from bench/results.
GPUS = {
    "v100": GPU("V100-SXM2-32GB", 125, 0.9, 32, 150, "NVIDIA V100 datasheet"),
    "a100": GPU("A100-SXM4-80GB", 312, 2.039, 80, 300, "NVIDIA A100 datasheet"),
    "h100": GPU("H100-SXM5-80GB", 989, 3.35, 80, 450, "NVIDIA H100 datasheet"),
    "h200": GPU("H200-SXM-141GB", 989, 4.8, 141, 450, "NVIDIA H200 datasheet"),
    "b200": GPU("B200-SXM-180GB", 2250, 8.0, 180, 900, "NVIDIA B200 datasheet"),
    "h200-measured": GPU("H200 (measured)", 614, 3.711, 141, 450,
                         "bench/results: GEMM rate at B_dense 2048, copy bandwidth"),
}

WORKLOADS = {"splitwise": (1155, 211), "lmsys": (102, 222), "sharegpt": (246, 322),
             "constant-512-512": (512, 512), "constant-1024-512": (1024, 512),
             "constant-512-1024": (512, 1024)}


def gpu_from(name: str, tflops=None, mem_bw_tbps=None, net_gbps=None) -> GPU:
    if name not in GPUS:
        raise NanojaxError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    g = GPUS[name]
    return dataclasses.replace(g, tflops=tflops or g.tflops,
                               mem_bw_tbps=mem_bw_tbps or g.mem_bw_tbps,
                               net_gbps=net_gbps or g.net_gbps)


def analyze(gpu: GPU, cfg: ModelConfig, batch: int, tp: int = 1, prompt: float = 512,
            output: float = 512, bytes_per_param: int = 2, nano_batch: int | None = None,
            expert_load=None) -> dict:
    """nano_batch: tokens per MLP nano-batch (None: the whole batch), and expert_load: the
    measured share of routing decisions per expert (None: uniform); MoE models only."""
    if batch <= 0 or tp <= 0 or (nano_batch is not None and nano_batch <= 0):
        raise NanojaxError("batch, tp and nano_batch must be positive")
    p = cfg.active_param_count()
    flops = gpu.tflops * 1e12
    bw = gpu.mem_bw_tbps * 1e12
    t_compute = 2 * p * batch / (tp * flops)
    weight_bytes = cfg.param_count() * bytes_per_param
    moe = {}
    if cfg.is_moe:
        from search.moe_cost import moe_compute_terms
        moe = moe_compute_terms(cfg, batch, nano_batch, flops, bw, tp, bytes_per_param,
                                expert_load)
        t_compute += moe["T_experts_s"] - moe["T_experts_ideal_s"]
        routed = cfg.param_count() - cfg.param_count(experts=0)
        weight_bytes += moe["expert_weight_bytes"] - routed * bytes_per_param
    decodes = batch * output / (prompt + output)
    kv_per_token = 2 * cfg.num_layers * cfg.kv_size * bytes_per_param
    kv_bytes = decodes * (prompt + output / 2) * kv_per_token
    t_mem = (weight_bytes + kv_bytes) / (tp * bw)
    if tp > 1:
        act = batch * cfg.hidden_size * bytes_per_param
        t_net = 2 * cfg.num_layers * act * 2 * (tp - 1) / tp / (gpu.net_gbps * 1e9)
    else:
        t_net = 0.0
    tr, nr = t_mem / t_compute, t_net / t_compute
    bound = "compute" if max(tr, nr) < 1 else ("memory" if tr >= nr else "network")
    return {"gpu": gpu.name, "params": cfg.param_count(), "active_params": p,
            "batch": batch, "tp": tp,
            "prompt_mean": prompt, "output_mean": output, "decode_tokens": decodes,
            "T_compute_s": t_compute, "T_mem_s": t_mem, "T_net_s": t_net,
            "TR": tr, "T_net_over_T_compute": nr, "bound": bound,
            "weight_bytes": weight_bytes, "kv_bytes_read": kv_bytes,
            "optimal_tokens_per_s_per_gpu": flops / (2 * p), **moe}


def table(models=("llama2-70b", "llama3-70b", "llama3-8b", "qwen2-72b"),
          gpus=("v100", "a100", "h100", "h200", "b200"), batch=2048,
          workload="splitwise") -> list[dict]:
    """Like the paper's Table 2: TR and the verdict across GPUs and models (TP 8 for the
    70B-class, 1 for 8B)."""
    p, d = WORKLOADS[workload]
    rows = []
    for m in models:
        cfg = named_shape(m)
        tp = 1 if cfg.param_count() < 2e10 else 8
        for g in gpus:
            rows.append({"model": m, **analyze(GPUS[g], cfg, batch, tp, p, d)})
    return rows
