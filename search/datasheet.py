"""A profile synthesized from the cost model (search/costmodel.py) and a GPU's datasheet,
for planning a machine we cannot measure (NanoFlow's 70B TP=8 on 8xA100).

Per GPU, on its 1/TP shard of every weight, each op of one layer at n tokens takes the
roofline time max(FLOPs / peak FLOP/s, bytes / HBM bandwidth):
  * qkv, o_proj, mlp (compute): the GEMMs over the shard's weight columns/rows,
  * attention (memory, position "prefix" as the profiler measures it): the dense batch
    holds the workload's decodes first, each reading its KV context (prompt + output / 2
    tokens of its shard's KV heads), then prefill tokens attending over half a prompt,
  * o_allreduce, mlp_allreduce (network): a ring all-reduce of n x hidden activations,
    2 (TP - 1) / TP of the bytes over the per-GPU NVLink bandwidth, plus a fixed latency.
Attention's time at a share R < 1 of the SMs: bandwidth is assumed to saturate at
SATURATING_SHARE of the SMs (time x max(1, SATURATING_SHARE / R)); a collective occupies
NETWORK_SHARE of the SMs. No interference table: stage II prices a GEMM at share R at
its time / R. These are datasheet peaks and assumptions, not measurements.
"""
from __future__ import annotations

from nanojax.config import ModelConfig
from search.costmodel import GPU

SATURATING_SHARE = 0.6
NETWORK_SHARE = 0.1
COLLECTIVE_LATENCY_S = 10e-6
ATTENTION_SHARES = (0.5, 0.9, 1.0)


def datasheet_profile(gpu: GPU, cfg: ModelConfig, tp: int, b_dense: int, granularity: int,
                      prompt: float, output: float, bytes_per_param: int = 2) -> dict:
    flops, bw = gpu.tflops * 1e12, gpu.mem_bw_tbps * 1e12
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    kv_local = kv * max(1, tp // cfg.num_kv_heads) / tp  # KV heads replicated past TP

    def gemm(n, k_in, k_out):
        w = k_in * k_out / tp
        return max(2 * n * w / flops, (w + n * (k_in + k_out)) * bytes_per_param / bw)

    decodes = round(b_dense * output / (prompt + output))
    ctx = prompt + output / 2

    def attention(n, share=1.0):
        d, p = min(n, decodes), max(0, n - decodes)
        read = (d * ctx + p * prompt / 2) * 2 * kv_local * bytes_per_param
        work = 4 * (d * ctx + p * prompt / 2) * q / tp
        t = max(read / bw, work / flops)
        return t * max(1.0, SATURATING_SHARE / share)

    def allreduce(n):
        if tp == 1:
            return 0.0
        msg = n * h * bytes_per_param
        return COLLECTIVE_LATENCY_S + msg * 2 * (tp - 1) / tp / (gpu.net_gbps * 1e9)

    sizes = range(granularity, b_dense + 1, granularity)
    ops = {"qkv": {"resource": "compute", "times": {n: gemm(n, h, q + 2 * kv) for n in sizes}},
           "attention": {"resource": "memory", "position": "prefix",
                         "times": {n: attention(n) for n in sizes},
                         "times_by_share": {str(r): {n: attention(n, r) for n in sizes}
                                            for r in ATTENTION_SHARES}},
           "o_proj": {"resource": "compute", "times": {n: gemm(n, q, h) for n in sizes}},
           "mlp": {"resource": "compute",
                   "times": {n: gemm(n, h, 2 * f) + gemm(n, f, h) for n in sizes}}}
    if tp > 1:
        for g in ("o_allreduce", "mlp_allreduce"):
            ops[g] = {"resource": "network", "share": NETWORK_SHARE,
                      "times": {n: allreduce(n) for n in sizes}}
    return {"version": 1, "b_dense": b_dense, "granularity": granularity,
            "workload": f"{prompt:g}/{output:g}", "model": cfg.signature(), "tp": tp,
            "ops": ops, "interference": {"measured": False,
                                         "reason": f"synthesized from the {gpu.source}"},
            "source": {"gpu": gpu.name, "tflops": gpu.tflops, "mem_bw_tbps": gpu.mem_bw_tbps,
                       "net_gbps": gpu.net_gbps, "saturating_share": SATURATING_SHARE,
                       "network_share": NETWORK_SHARE,
                       "collective_latency_s": COLLECTIVE_LATENCY_S}}


def non_overlap_time(profile) -> float:
    """One layer with every op on the whole batch, one after another (search.milp.Profile)."""
    b = profile.b_dense
    return sum(profile.span_time(g, 0, b) for g in profile.groups)
