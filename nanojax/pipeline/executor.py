"""Builds the decoder step from a plan: nano-batches, nano-op order, streams, shares.

For every layer the dense batch is cut, per op group, into the plan's token ranges; the
nano-ops run in the plan's order, each reading the slices of its predecessor's outputs
that cover its range.

- An attention nano-op appends its tokens' keys and values to the layer's pages, then
  attends: both on its stream, so the main stream never waits on the cache. The pages go
  from one attention nano-op to the next through an optimization barrier, which orders the
  next append after this read; without it XLA copies the whole cache per nano-op.
- The scheduler ends prefill chunks at the attention cuts (`chunk_cuts`), so each attention
  nano-batch holds whole chunks and the plan may order them freely.
- Main-stream nano-ops are chained in plan order through optimization barriers: otherwise
  XLA reorders them and, with its dot merger on (`--merge-dots`; off by default), merges
  the nano-batches' GEMMs back into one.
- On the GPU, a nano-op on stream N > 0 is placed with `compute_on("gpu_stream:N")` (see
  streams.py); elsewhere streams are ignored, so every mode computes the same function and
  must give the same tokens.
- XLA (jax 0.11) runs a side-stream region as an async start/done pair on the main thread,
  so its scheduler sees no latency to hide and puts the done right after the start: the
  main stream waits (on the H200 no attention ran under a GEMM; measured:
  bench/results/log/overlap_search.md). What keeps regions concurrent is an XLA
  scheduling group (`_scheduling_group_id`): its starts are scheduled before
  its dones. Only async pairs keep the annotation through XLA's fusion passes, so the
  GEMMs that should run beside attention go on a second side stream and join the
  attention's group (`overlap_groups`; `scheduling_groups=True`).
- A fused pair (plan.py, "fused") is one launch on the main stream: the GEMM nano-op's
  first GEMM and the attention nano-op's decode attention split the SMs by program id
  (fused.py), after the attention's append; where that kernel cannot run, the two nano-ops
  run one after the other (the nanobatch-only mode's math) and `fused_report` says why.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from nanojax.config import KernelConfig, ModelConfig
from nanojax.engine.forward import (Forward, UnrolledForward, default_forward,
                                    gpu_compiler_options)
from nanojax.layers.attention import AttentionBackend, PagedMetadata, slice_metadata
from nanojax.layers.matmul import matmul_at
from nanojax.models.llama import DecoderLayer, LlamaForCausalLM
from nanojax.pipeline import fused
from nanojax.pipeline.plan import (GEMM_GROUPS, NETWORK_GROUPS, ablation, check_model,
                                   check_order, fused_pairs, plan_groups, producers,
                                   validate)
from nanojax.pipeline.streams import (carry_metadata_to_stream_calls, on_stream,
                                      scheduling_group, streams_enabled)
from pallas_kernels.device import device_sms

log = logging.getLogger(__name__)


def overlap_groups(plan: dict) -> dict[tuple[str, int], int]:
    """(op, batch) -> XLA scheduling group. A group opens at a side-stream op (the anchor)
    and takes the ops after it, in plan order, that run on another side stream, until one
    consumes the anchor's output or the anchor's stream is used again. XLA schedules a
    group's async starts before all of its dones, so its regions run concurrently.
    Main-stream ops cannot join: XLA's fusion passes drop their annotation; collectives
    (stream 3) are XLA's own async pairs and join none."""
    nb = plan["nano_batches"]
    producer = producers(plan_groups(plan))
    groups: dict[tuple[str, int], int] = {}
    anchor, gid = None, 0
    for op in plan["nano_ops"]:
        g, k, stream = op["op"], op["batch"], op.get("stream", 0)
        if stream == 3:
            continue
        if anchor is not None:
            ag, ak, astream = anchor
            a, b = nb[g][k]
            c, d = nb[ag][ak]
            if (producer.get(g) == ag and a < d and c < b) or stream == astream:
                anchor = None  # consumes the anchor's output, or reuses its stream
            elif stream != 0:
                groups[(g, k)] = gid
                continue
        if anchor is None and stream != 0:
            gid += 1
            anchor = (g, k, stream)
            groups[(g, k)] = gid
    return {key: v for key, v in groups.items()
            if sum(1 for w in groups.values() if w == v) > 1}


def _gather(pieces: dict, ranges: list, a: int, b: int):
    """The rows [a, b) of an op's output, from the nano-batch pieces that cover them."""
    parts = []
    for j, (c, d) in enumerate(ranges):
        lo, hi = max(a, c), min(b, d)
        if lo < hi:
            parts.append(jax.tree_util.tree_map(lambda x: x[lo - c:hi - c], pieces[j]))
    if len(parts) == 1:
        return parts[0]
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)


def _clip(ranges, t):
    out = [[a, min(b, t)] for a, b in ranges if a < t]
    out[-1][1] = t  # a larger batch than the plan's B_dense goes into the last nano-batch
    return out


KEEP = ("", "inputs", "values")  # PipelineForward's keep diagnostic
KEEP_BYTES = 256 << 20  # keep="values" leaves out larger values (a layer's KV pages)


def side_stream_kernels(kernels: KernelConfig) -> KernelConfig:
    """The kernels of nano-ops on a side stream: "auto" means no Mosaic GPU kernel there
    (their compile inside async computations, see PipelineForward): Triton's decode
    attention, XLA's ragged_dot for an MoE block's expert GEMMs."""
    side = {"decode_kernel": "triton", "grouped_gemm": "xla"}
    return kernels.replace(**{k: v for k, v in side.items() if getattr(kernels, k) == "auto"})


class PipelineForward(UnrolledForward):
    """The Forward interface (see engine/forward.py) driven by a plan."""

    def __init__(self, cfg: ModelConfig, plan: dict, mode: str = "overlap",
                 kernels: KernelConfig = KernelConfig(),
                 attention: AttentionBackend | None = None, num_sms: int | None = None,
                 ctas_per_sm: int = 4, scheduling_groups: bool = True, keep: str = "",
                 tp: int = 1):
        """kernels: the kernels and placement (streams, GEMM shares); attention: a backend
        other than the one the kernels describe (tests); num_sms: the SMs a plan's shares
        divide (None: those of the device the step runs on, device_sms); ctas_per_sm:
        Triton decode programs an SM; tp: the tensor-parallel degree the plan must be made
        for (the engine wraps this forward per shard)."""
        validate(plan)
        check_model(plan, cfg, tp)
        self.plan = ablation(plan, mode)
        check_order(self.plan)
        self.mode = mode
        self.kernels = kernels
        # attention nano-ops on a side stream: with the default kernel choice, Triton's.
        # On jax 0.11.2 a 32-layer overlap step whose side streams held the Mosaic GPU
        # swap-AB kernel had not finished compiling after minutes (XLA instantiating
        # Mosaic custom calls inside async computations one by one), where the same step
        # with Triton compiled in about a minute (bench/results/log/overlap_search.md)
        side_kernels = side_stream_kernels(kernels)
        if attention is None:
            attention = default_forward(cfg, kernels).attention
            self.side_attention = attention
            if side_kernels.decode_kernel != kernels.decode_kernel:
                self.side_attention = default_forward(cfg, side_kernels).attention
        else:
            self.side_attention = attention
        super().__init__(cfg, attention)
        self.grouped_gemm = kernels.grouped_gemm
        self.act_quant = kernels.act_quant
        # an MoE block's GEMM nano-op on a side stream: the same rule as attention's
        self.side_grouped_gemm = side_kernels.grouped_gemm
        side = streams_enabled(kernels.streams) and any(  # network ops: never placed
            op.get("stream", 0) != 0 and op["op"] not in NETWORK_GROUPS
            for op in self.plan["nano_ops"])
        self.compiler_options = gpu_compiler_options(kernels, side_streams=side)
        self.num_sms = device_sms() if num_sms is None else num_sms
        self.ctas_per_sm = ctas_per_sm
        # a diagnostic for cross-stream buffer reuse: each side-stream region also returns
        # its inputs ("inputs") or every value it computes ("values"), so they stay alive
        # to its done. On the H200 neither changed the overlap mode's tokens: those differ
        # by kernel choice, not by a race (bench/results/log/overlap_search.md)
        if keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, got {keep!r}")
        self.keep = keep
        # the fused pairs (overlap mode only: the ablations drop them), and how each ran
        # in the last trace: {"gemm[k]+attention[j]": {"launch", "reason", ...}}
        self.pairs = fused_pairs(self.plan)
        self.fused_report: dict[str, dict] = {}
        self.fused_device: dict = {}  # fused.unavailable's hopper / sms (tests pin them)
        self.chunk_cuts = tuple(a for a, _ in self.plan["nano_batches"]["attention"][1:])
        self.groups_in_order = plan_groups(self.plan)
        self.producer = producers(self.groups_in_order)
        self.groups = (overlap_groups(self.plan)
                       if scheduling_groups and streams_enabled(kernels.streams) else {})
        if self.groups and not carry_metadata_to_stream_calls():
            import warnings
            warnings.warn("this jax's compute_on lowering could not be extended: "
                          "running without XLA scheduling groups")
            self.groups = {}

    def __call__(self, params, tokens, kv, meta: PagedMetadata, logit_idx):
        t = tokens.shape[0]
        groups = self.groups_in_order
        ranges = {g: _clip(self.plan["nano_batches"][g], t) for g in groups}
        ops = [op for op in self.plan["nano_ops"]
               if op["batch"] < len(ranges[op["op"]])]
        model = self.model
        x = model.apply(params, tokens, method=LlamaForCausalLM.embed_tokens)
        # each attention nano-batch's metadata, sliced and prepared once for all layers
        metas = [self.attention.prepare(slice_metadata(meta, a, b))
                 for a, b in ranges["attention"]]
        new_kv = []
        chain = None  # the last main-stream nano-op's output: the next one waits for it

        def placed(f, stream, *args, keep=None):
            """f on its stream; keep: which args a side-stream region also returns under
            keep="inputs" (never the KV pages: keeping their old version copies them)."""
            nonlocal chain
            if stream == 0 and chain is not None:
                args, _ = jax.lax.optimization_barrier((args, chain))
            enabled = self.kernels.streams
            if stream == 0 or not self.keep:
                out = on_stream(f, stream, enabled=enabled)(*args)
            else:
                if self.keep == "values":  # every value inside the region: its own buffer
                    region = on_stream(f, stream, KEEP_BYTES, enabled=enabled)
                else:  # the region's inputs come out of it, so they live until it is done
                    idx = range(len(args)) if keep is None else keep
                    region = on_stream(lambda *a: (f(*a), [a[i] for i in idx]), stream,
                                       enabled=enabled)
                out, kept = region(*args)
                out, _ = jax.lax.optimization_barrier((out, kept))
            if stream == 0:
                chain = out
            return out

        for li, kv_layer in enumerate(kv):
            lp = {"params": params["params"][f"layers_{li}"]}
            out: dict = {g: {} for g in groups}
            by_key = {(op["op"], op["batch"]): op for op in ops}
            paired = set()  # nano-ops already run as part of a fused pair
            for op in ops:
                g, k = op["op"], op["batch"]
                if (g, k) in paired:
                    continue
                pair = self.pairs.get((g, k))
                other = None if pair is None else (
                    pair["gemm"] if g == "attention" else ("attention", pair["attention"]))
                if other in by_key:  # both sides in this batch (a short one may lack one)
                    paired.add(other)
                    kv_layer = self._pair(op, by_key[other], pair, lp, x, metas, ranges,
                                          out, kv_layer, placed)
                    continue
                gid = self.groups.get((g, k))
                # the scope names the nano-op in the HLO's metadata
                # (nanojax/profiling/hlo_schedule.py reads it)
                with scheduling_group(None if gid is None else li * 1000 + gid), \
                        jax.named_scope(f"nanoop_{g}_b{k}"):
                    kv_layer = self._nano_op(op, lp, x, metas, ranges, out, kv_layer,
                                             placed)
            x = _gather(out[groups[-1]], ranges[groups[-1]], 0, t)
            new_kv.append(kv_layer)
        return model.apply(params, x[logit_idx], method=LlamaForCausalLM.logits), new_kv

    def _nano_op(self, op, lp, x, metas, ranges, out, kv_layer, placed):
        """Emits one nano-op; returns the layer's KV pages (changed by attention only).
        A GEMM nano-op's share bounds its matmuls' grid where enabled (layers/matmul.py).
        metas: each attention nano-batch's metadata."""
        g, k = op["op"], op["batch"]
        share = float(op.get("share", 1.0))
        stream = op.get("stream", 0)
        side = stream != 0 and self.kernels.streams
        layer = self.layer(None if g == "attention" else
                           matmul_at(share, self.num_sms, self.kernels.gemm_shares),
                           grouped_gemm=self.side_grouped_gemm if side else None)
        inv_freq = self.model.inv_freq
        a, b = ranges[g][k]
        if g in GEMM_GROUPS:
            f, args = self._gemm(g, layer, x, a, b, out, ranges)
            out[g][k] = placed(f, stream, lp, *args)
        elif g == "attention":
            q, kk, vv = _gather(out["qkv"], ranges["qkv"], a, b)
            m = metas[k]
            backend = self.side_attention if side else self.attention
            attend = backend.attend_at(share, self.num_sms, self.ctas_per_sm)

            def f(q, kk, vv, kvl, m):
                kvl = backend.append(kk, vv, kvl, m, inv_freq)
                return attend(q, kvl, m, inv_freq), kvl
            o, kv_layer = placed(f, stream, q, kk, vv, kv_layer, m, keep=(0, 1, 2, 4))
            out[g][k], kv_layer = jax.lax.optimization_barrier((o, kv_layer))
        else:  # a network nano-op: residual + the sum of the shards' partial outputs
            src = self.producer[g]
            partial = _gather(out[src], ranges[src], a, b)
            residual = x[a:b] if g == "o_allreduce" else _gather(
                out[self.producer[src]], ranges[self.producer[src]], a, b)
            reduce = self.model.reduce or (lambda y: y)
            f = lambda p, r: r + reduce(p)  # noqa: E731
            # stream 3: outside the main stream's chain, so XLA's async all-reduce may
            # run under the other nano-batches' GEMMs; stream 0: chained (ablations)
            out[g][k] = f(partial, residual) if stream == 3 else placed(f, 0, partial,
                                                                         residual)
        return kv_layer

    def _gemm(self, g, layer, x, a, b, out, ranges):
        """A GEMM nano-op over tokens [a, b): (f(lp, *args), args)."""
        return self._gemm_fn(g, layer, out), self._gemm_args(g, x, a, b, out, ranges)

    def _gemm_args(self, g, x, a, b, out, ranges) -> tuple:
        if g == "qkv":
            return (x[a:b],)
        if g == "o_proj":
            attn = _gather(out["attention"], ranges["attention"], a, b)
            # the partial sum under TP (o_allreduce adds the shards' sums and the residual)
            return (attn,) if "o_allreduce" in out else (attn, x[a:b])
        return (_gather(out[self.producer[g]], ranges[self.producer[g]], a, b),)

    @staticmethod
    def _gemm_fn(g, layer, out):
        if g == "qkv":
            return lambda lp, xs: layer.apply(lp, xs, method=DecoderLayer.qkv)
        if g == "o_proj":
            if "o_allreduce" in out:
                return lambda lp, o: layer.apply(lp, o, method=DecoderLayer.attn_out_partial)
            return lambda lp, o, r: layer.apply(lp, o, r, method=DecoderLayer.attn_out)
        method = DecoderLayer.mlp_partial if "mlp_allreduce" in out else DecoderLayer.mlp
        return lambda lp, h: layer.apply(lp, h, method=method)

    def _pair(self, first, second, pair, lp, x, metas, ranges, out, kv_layer, placed):
        """A fused pair (plan.py): one launch where it can run (fused.py), else its two
        nano-ops in plan order. Either way the reason lands in fused_report."""
        g, k = pair["gemm"]
        j = pair["attention"]
        a, b = ranges["attention"][j]
        q, kk, vv = _gather(out["qkv"], ranges["qkv"], a, b)
        name = f"{g}[{k}]+attention[{j}]"
        why = fused.unavailable(self.attention, pair, q, kv_layer, **self.fused_device)
        if why is not None:
            self._report(name, pair, why)
            for op in (first, second):
                with jax.named_scope(f"nanoop_{op['op']}_b{op['batch']}"):
                    kv_layer = self._nano_op(op, lp, x, metas, ranges, out, kv_layer,
                                             placed)
            return kv_layer
        m = metas[j]
        backend, inv_freq = self.attention, self.model.inv_freq
        status = {}

        def f(lp, gemm_args, q, kk, vv, kvl, m):
            with jax.named_scope(f"nanoop_attention_b{j}"):  # the append, as its nano-op's
                kvl = backend.append(kk, vv, kvl, m, inv_freq)
            mm = fused.PairMatmul(backend.attend_with, q, kvl, m, inv_freq,
                                  gemm_programs=pair["gemm_programs"],
                                  programs=pair["programs"])
            with jax.named_scope(f"nanoop_{g}_b{k}"):  # the launch: the GEMM's scope
                y = self._gemm_fn(g, self.layer(mm), out)(lp, *gemm_args)
                o = mm.attention_out
                if o is None:  # no GEMM of the op fits the kernel: attention after it
                    o = backend.attend(q, kvl, m, inv_freq)
            status["why"] = mm.why
            return y, o, kvl
        ga, gb = ranges[g][k]
        y, o, kvl = placed(f, 0, lp, self._gemm_args(g, x, ga, gb, out, ranges),
                           q, kk, vv, kv_layer, m)
        self._report(name, pair, status["why"])
        out[g][k] = y
        out["attention"][j], kv_layer = jax.lax.optimization_barrier((o, kvl))
        return kv_layer

    def _report(self, name, pair, why):
        """fused_report[name]; the first time a pair falls back for a reason, a log line."""
        entry = {"launch": "fused" if why is None else "back to back",
                 "gemm_programs": pair["gemm_programs"], "programs": pair["programs"],
                 "reason": why or ""}
        if why is not None and self.fused_report.get(name) != entry:
            log.warning("fused pair %s runs back to back: %s", name, why)
        self.fused_report[name] = entry


if TYPE_CHECKING:  # mypy (.ci/run) checks that the executor is a Forward
    _FORWARD: type[Forward] = PipelineForward
