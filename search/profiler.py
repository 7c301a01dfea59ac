"""The profiler behind `nanojax profile`: what the search needs to know about this device.

1. Interference-free time of each op group of one layer (qkv, attention, o_proj, mlp) at
   every batch size in multiples of the granularity up to B_dense; attention also at each
   resource share (the decode kernel's program count). Attention is position-dependent,
   as in the executor: the dense batch holds decodes first, then prefill chunks, so it is
   profiled as the append and attention of the first n tokens of one steady-state dense
   batch of the workload (bench/step.py; chunks end at every multiple of the
   granularity, as the scheduler ends them at the plan's cuts), `"position": "prefix"`;
   the search charges a nano-batch [a, b) times[b] - times[a]. The cache is threaded
   through the timing loop as the executor threads it (no copy of the cache per call).
2. The interference table (GPU, streams on): the MLP and attention at share R, each on its
   own side stream in one XLA scheduling group so that they run together (as the
   executor runs them, attention with the executor's side-stream kernel: Triton's where
   the main stream's is Mosaic GPU, whose custom calls inside async computations compiled
   for minutes, see nanojax/pipeline/executor.py); from the trace, each kernel's time
   together over its time alone is its normalized performance P (NanoFlow's Table 3).

3. The fused pair (`pair_shares`, issue 18): one launch of a GEMM nano-op on G programs
   beside decode attention on the rest, timed against each side alone and back to back
   over G at the model's nano-batch shapes (nanojax/profiling/fused_pair.py: a GEMM of
   half the dense batch's tokens, the attention of half its decodes at their mean
   context), SM clock and power sampled per case; stored as the profile's "pair", which
   `nanojax search` reads in place of the two-stream table. Hopper GPUs only; elsewhere
   "pair" says why it was skipped.

4. Under tensor parallelism (tp > 1): the compute and memory ops on one shard's shape
   (parallel/tp.py, random weights), and the network ops (o_allreduce, mlp_allreduce):
   a psum of n x hidden activations over a `tp` mesh in shard_map, timed on the device.

The result is the search's input (search/milp.py, Profile), saved as JSON with the
hardware and software it was measured on.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nanojax.config import KernelConfig
from nanojax.engine.forward import default_forward
from nanojax.layers.attention import slice_metadata
from nanojax.layers.kv_fp8 import QuantizedKV, is_fp8, quantize, resolve_kv_cache_dtype
from nanojax.models.llama import DecoderLayer, LlamaForCausalLM
from nanojax.pipeline.executor import side_stream_kernels
from nanojax.profiling.synthetic import engine_batch_rows, synthetic_batch, workload_lengths
from nanojax.profiling.timing import device_seconds, device_seconds_stateful
from pallas_kernels.device import device_sms
from search.milp import SearchError

COMPUTE_OPS = ("qkv", "o_proj", "mlp")


class LayerOps:
    """One decoder layer's ops on random inputs of n tokens, with the kernels given."""

    def __init__(self, bundle, b_dense: int, granularity: int, workload: str = "512/512",
                 page_size: int = 16, num_pages: int = 16384, max_model_len: int = 2048,
                 num_sms: int | None = None, kernels: KernelConfig = KernelConfig(),
                 kv_cache_dtype: str = "auto"):
        """num_sms: the SMs an attention share divides (None: the device's, as the
        executor's); kv_cache_dtype: the pages attention reads (--kv-cache-dtype)."""
        self.kernels = kernels
        self.cfg = cfg = bundle.config
        self.layer = DecoderLayer(cfg)
        self.lp = jax.device_put({"params": bundle.params["params"]["layers_0"]})
        self.dtype = jnp.dtype(cfg.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, cfg.dtype)
        self.lengths = workload_lengths(workload, max_model_len)
        self.page_size, self.num_pages = page_size, num_pages
        self.num_sms = device_sms() if num_sms is None else num_sms
        self.max_pages = -(-max_model_len // page_size)
        forward = default_forward(cfg, kernels)
        self.attention = forward.attention
        side = side_stream_kernels(kernels)  # what the executor runs on a side stream
        self.side_attention = (self.attention if side == kernels
                               else default_forward(cfg, side).attention)
        self.compiler_options = forward.compiler_options  # XLA options the step compiles with
        self.inv_freq = LlamaForCausalLM(cfg).inv_freq
        cuts = tuple(range(granularity, b_dense, granularity))
        self.dense = synthetic_batch(cfg, b_dense, self.lengths, page_size, num_pages,
                                     self.max_pages, cuts,
                                     prefill_block_q=self.attention.prefill_block_q,
                                     prefill_max_seqs=self.attention.prefill_max_seqs,
                                     rows=engine_batch_rows({workload: self.lengths},
                                                            b_dense, cuts))
        self.mix = {}  # n -> (decodes, prefill tokens) of the attention batch profiled

    def inputs(self, op: str, n: int):
        c, key = self.cfg, jax.random.PRNGKey(n)
        if op == "qkv" or op == "mlp":
            return (jax.random.normal(key, (n, c.hidden_size), self.dtype),)
        if op == "o_proj":
            return (jax.random.normal(key, (n, c.num_heads, c.head_dim), self.dtype),
                    jax.random.normal(key, (n, c.hidden_size), self.dtype))
        d = min(n, self.dense.num_decodes)
        self.mix[n] = (d, n - d)
        # prepared as the executor prepares a nano-batch's (the decode order, once a step)
        meta = self.attention.prepare(slice_metadata(jax.device_put(self.dense.meta), 0, n))
        shape = (self.num_pages, c.num_kv_heads, self.page_size, c.head_dim)
        # two buffers (the timing loop donates the cache)
        k_pages, v_pages = (jax.random.normal(key, shape, self.dtype) for _ in range(2))
        if is_fp8(self.kv_dtype):  # as the engine's FP8 cache: e4m3 pages, scales of 1.0
            scale = jnp.ones((c.num_kv_heads,), jnp.float32)
            kv = QuantizedKV(quantize(k_pages, scale, head_axis=1),
                             quantize(v_pages, scale, head_axis=1), scale, scale + 0)
        else:
            kv = (k_pages.astype(self.kv_dtype), v_pages.astype(self.kv_dtype))
        q = jax.random.normal(key, (n, c.num_heads, c.head_dim), self.dtype)
        k = jax.random.normal(key, (n, c.num_kv_heads, c.head_dim), self.dtype)
        return q, k, k, kv, meta

    def fn(self, op: str, share: float = 1.0, side: bool = False):
        """The op; attention takes the cache first and returns it: (kv, out). side: with
        the side-stream attention kernel."""
        layer, lp = self.layer, self.lp
        if op == "qkv":
            return lambda x: layer.apply(lp, x, method=DecoderLayer.qkv)
        if op == "o_proj":
            return lambda a, r: layer.apply(lp, a, r, method=DecoderLayer.attn_out)
        if op == "mlp":
            return lambda h: layer.apply(lp, h, method=DecoderLayer.mlp)
        backend = self.side_attention if side else self.attention
        attend = backend.attend_at(share, self.num_sms)

        def attention(kv, q, k, v, meta):
            kv = backend.append(k, v, kv, meta, self.inv_freq)
            return kv, attend(q, kv, meta, self.inv_freq)
        return attention

    def seconds(self, op: str, n: int, share: float = 1.0, iters: int = 10,
                side: bool = False) -> float:
        if op == "attention":
            q, k, v, kv, meta = self.inputs(op, n)
            return device_seconds_stateful(self.fn(op, share, side), kv, q, k, v, meta,
                                           iters=iters)
        return device_seconds(self.fn(op, share), *self.inputs(op, n), iters=iters,
                              compiler_options=self.compiler_options)


def interference_table(lay: LayerOps, n: int, shares, alone=None, progress=None) -> dict:
    """The MLP (stream 2) beside attention (stream 1) at each share, both in one XLA
    scheduling group so that they run together, one call traced per share:
    P = time alone / time together, for each kernel kind; attention with the side-stream
    kernel (LayerOps.side_attention). alone: {"gemm": seconds, "attention": {share:
    seconds}} of those kernels already measured at n tokens (else measured here)."""
    from nanojax.profiling import timeline
    from nanojax.pipeline.streams import (carry_metadata_to_stream_calls, on_stream,
                                          scheduling_group)

    if not carry_metadata_to_stream_calls():
        return {"measured": False, "reason": "this jax cannot group stream regions"}
    mlp, mlp_in = lay.fn("mlp"), lay.inputs("mlp", n)
    q, k, v, kv, meta = lay.inputs("attention", n)
    alone = alone or {}
    alone = {"gemm": alone.get("gemm") or lay.seconds("mlp", n),
             "attention": alone.get("attention") or {
                 r: lay.seconds("attention", n, r, side=True) for r in shares}}
    rows = []
    for share in shares:
        att = lay.fn("attention", share, side=True)

        def together(h, kv, q, k, v, meta):
            with scheduling_group(1):
                kv, o = on_stream(att, 1, enabled=lay.kernels.streams)(kv, q, k, v, meta)
                return on_stream(mlp, 2, enabled=lay.kernels.streams)(h), o, kv
        f = jax.jit(together, donate_argnums=(1,))
        sched = _pair_schedule(f.lower(*mlp_in, kv, q, k, v, meta).compile().as_text())
        *_, kv = f(*mlp_in, kv, q, k, v, meta)
        jax.block_until_ready(kv)
        holder = {}

        def once(kv=kv):
            holder["out"] = f(*mlp_in, kv, q, k, v, meta)
            jax.block_until_ready(holder["out"])
        ev = timeline.capture(once)
        kv = holder["out"][-1]
        s = timeline.summarize(ev)
        both = {k: s["kernel_us"][k] * 1e-6 for k in ("gemm", "attention")}
        att_alone = alone["attention"][share]
        rows.append({"share": share,
                     "compute": min(1.0, alone["gemm"] / max(both["gemm"], 1e-12)),
                     "memory": min(1.0, att_alone / max(both["attention"], 1e-12)),
                     "attention_overlapped_by_gemm": s["attention_overlapped_by_gemm"],
                     "schedule": sched})
        if progress:
            progress(rows[-1])
    return {"measured": True, "tokens": n, "rows": rows}


def _pair_schedule(hlo_text: str) -> dict:
    """Did XLA issue regions of the two streams together? (A region of one stream starts
    between the start and done of a region of the other; a kernel's own regions, e.g.
    the append then the attention, are data-dependent and never overlap.)"""
    from nanojax.profiling.hlo_schedule import entry_instructions, side_regions
    regions = sorted(side_regions(entry_instructions(hlo_text)), key=lambda r: r["position"])
    together = any(a["stream"] != b["stream"] and a["position"] < b["position"] < a["done_at"]
                   for a in regions for b in regions)
    return {"side_regions": len(regions), "issued_together": together,
            "regions": [{"stream": r["stream"], "start": r["position"], "done": r["done_at"],
                         "group": r["group"]} for r in regions]}


def network_times(hidden: int, dtype, sizes, tp: int, iters: int = 10) -> dict[int, float]:
    """Seconds of one all-reduce of n x hidden activations over tp devices, for each n
    (the network nano-op, as the executor issues it: a psum inside shard_map)."""
    from jax.sharding import PartitionSpec as P

    from nanojax.parallel.tp import TP_AXIS, make_mesh
    mesh = make_mesh(tp)
    f = jax.shard_map(lambda x: jax.lax.psum(x, TP_AXIS), mesh=mesh, in_specs=P(TP_AXIS),
                      out_specs=P(TP_AXIS), check_vma=False)
    out = {}
    for n in sizes:  # each device holds its own [n, hidden] partial sums
        x = jnp.ones((tp * n, hidden), dtype)
        out[n] = device_seconds(f, x, iters=iters)
    return out


def shard_bundle(bundle, tp: int):
    """One TP shard's shape with random weights (one layer): what each GPU computes."""
    from nanojax.models import init_params
    from nanojax.models.bundle import ModelBundle
    from nanojax.parallel.tp import TPLayout
    cfg = TPLayout(bundle.config, tp).shard_config.replace(num_layers=1)
    return ModelBundle(cfg, init_params(cfg), None)


def pair_spec(lay: LayerOps, b_dense: int, granularity: int, pair_shares,
              power_seconds: float = 1.0, gemms=None):
    """The fused pair's shapes for this profile: a GEMM nano-batch of half the dense batch
    (a multiple of the granularity), beside half its decodes at their mean context.
    gemms: the GEMM nano-ops to pair (None: qkv, o, gate_up and down)."""
    import numpy as np

    from nanojax.profiling.fused_pair import model_spec
    tokens = max(granularity, b_dense // 2 // granularity * granularity)
    d = lay.dense.num_decodes
    ctx = np.asarray(lay.dense.meta.positions)[:d] + 1 if d else np.array([lay.page_size])
    ctx = int(-(-float(ctx.mean()) // lay.page_size) * lay.page_size)
    spec = model_spec(lay.cfg, tokens, max(1, d // 2), ctx, pair_shares,
                      power_seconds=power_seconds)
    if gemms:
        unknown = sorted(set(gemms) - set(spec.gemms))
        if unknown:
            raise SearchError(f"pair GEMMs {unknown} unknown; choose from {list(spec.gemms)}")
        spec.gemms = {g: spec.gemms[g] for g in gemms}
    return spec


def measure_pair_or_skip(lay, b_dense, granularity, pair_shares, power_seconds=1.0,
                         log=None, gemms=None, saved=None) -> dict:
    """The profile's "pair": the fused pair's record, or {"measured": False, "reason"}.
    saved: handed the record so far after each GEMM (measure_pair)."""
    import sys

    from nanojax.profiling.fused_pair import measure_pair, unavailable
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    why = unavailable()
    if why is not None:
        log(f"nanojax: fused pair not measured: {why}")
        return {"measured": False, "reason": why}
    spec = pair_spec(lay, b_dense, granularity, pair_shares, power_seconds, gemms)
    try:
        return measure_pair(spec, "nanojax profile --pair-shares", log=log, saved=saved)
    except Exception as e:  # keep the minutes of op profile: the search then plans no overlap
        why = f"the pair failed: {type(e).__name__}: {str(e)[:500]}"
        log(f"nanojax: fused pair not measured: {why}")
        return {"measured": False, "reason": why}


def check_pair_pages(pair_shares, kv_cache_dtype: str) -> None:
    """The fused pair's attention reads 16-bit pages only (nanojax/profiling/fused_pair.py)."""
    if pair_shares and is_fp8(resolve_kv_cache_dtype(kv_cache_dtype, "bfloat16")):
        raise SearchError("the fused GEMM + attention pair reads bf16 pages only: profile "
                          "FP8 pages without --pair-shares")


def run_profile(bundle, b_dense: int, granularity: int, workload: str = "512/512",
                shares=(0.25, 0.5, 1.0), iters: int = 10, progress: bool = True,
                num_pages: int = 16384, tp: int = 1,
                kernels: KernelConfig = KernelConfig(), pair_shares=(),
                pair_power_seconds: float = 1.0, pair_gemms=None, checkpoint=None,
                kv_cache_dtype: str = "auto") -> dict:
    """kv_cache_dtype: the pages attention reads (fp8: the FP8 cache's kernels); pair_shares: the GEMM programs G to measure the fused pair at (empty: not
    measured, no "pair"); pair_gemms: its GEMM nano-ops (None: all four). checkpoint(out)
    is called with the op profile before the pair is measured (minutes with the Mosaic
    GPU kernels: a run cut short there keeps the op profile, which the search reads as
    "no pair measured")."""
    from tqdm.auto import tqdm

    from nanojax.pipeline.streams import streams_enabled
    from nanojax.profiling.record import environment
    if b_dense % granularity:
        raise SearchError(f"B_dense {b_dense} is not a multiple of the granularity {granularity}")
    check_pair_pages(pair_shares, kv_cache_dtype)
    signature = bundle.config.signature()
    if tp > 1:
        bundle = shard_bundle(bundle, tp)
    lay = LayerOps(bundle, b_dense, granularity, workload, num_pages=num_pages,
                   kernels=kernels, kv_cache_dtype=kv_cache_dtype)
    sizes = list(range(granularity, b_dense + 1, granularity))
    shares = sorted(set(shares) | {1.0})
    bar = tqdm(total=len(sizes) * (len(COMPUTE_OPS) + len(shares)), desc="profile",
               disable=not progress)
    ops = {}
    for op in COMPUTE_OPS:
        times = {}
        for n in sizes:
            times[n] = lay.seconds(op, n, iters=iters)
            bar.update(1)
        ops[op] = {"resource": "compute", "times": times}
    by_share = {}
    for share in shares:
        by_share[share] = {}
        for n in sizes:
            by_share[share][n] = lay.seconds("attention", n, share, iters=iters)
            bar.update(1)
    ops["attention"] = {"resource": "memory", "times": by_share[1.0],
                        "times_by_share": {str(s): t for s, t in by_share.items()},
                        "position": "prefix",
                        "decodes_and_prefill_tokens": {n: list(lay.mix[n]) for n in sizes}}
    if tp > 1:
        net = network_times(bundle.config.hidden_size, lay.dtype, sizes, tp, iters)
        for g in ("o_allreduce", "mlp_allreduce"):  # the same message after each block
            ops[g] = {"resource": "network", "times": net, "share": 0.1}
    bar.close()
    if streams_enabled(kernels.streams):
        n = sizes[(len(sizes) - 1) // 2]  # about half the dense batch, a profiled size
        same = lay.side_attention is lay.attention  # else the side kernel is timed there
        table = interference_table(lay, n, shares, alone={
            "gemm": ops["mlp"]["times"][n],
            "attention": {r: by_share[r][n] for r in shares} if same else None})
    else:  # one stream: nothing runs together, so there is nothing to measure
        table = {"measured": False, "reason": "no concurrent streams on this backend"}
    out = {"version": 1, "b_dense": b_dense, "granularity": granularity,
           "workload": workload, "model": signature, "tp": tp, "ops": ops,
           "quantization": bundle.config.quantization, "kv_cache_dtype": str(lay.kv_dtype),
           "interference": table, "environment": environment(),
           "kernels": dataclasses.asdict(kernels)}
    if pair_shares:
        if checkpoint:
            checkpoint({**out, "pair": {"measured": False,
                                        "reason": "the run ended while the pair was measured"}})
        out["pair"] = measure_pair_or_skip(
            lay, b_dense, granularity, pair_shares, pair_power_seconds, gemms=pair_gemms,
            saved=checkpoint and (lambda rec: checkpoint({**out, "pair": rec})))
    return out
