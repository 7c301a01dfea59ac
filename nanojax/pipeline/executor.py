"""Builds the decoder step from a plan: nano-batches, nano-op order, streams, shares.

For every layer the dense batch is cut, per op group, into the plan's token ranges; the
nano-ops run in the plan's order, each reading the slices of its predecessor's outputs
that cover its range. Attention nano-ops thread the layer's KV pages from one to the next
(a prefill chunk may straddle two nano-batches). On the GPU, a nano-op on stream N > 0 is
placed with `compute_on("gpu_stream:N")`; elsewhere streams are ignored, so every mode
computes the same function and must give the same tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from nanojax.config import ModelConfig
from nanojax.engine.forward import UnrolledForward, default_forward
from nanojax.layers.attention import PagedMetadata, paged_attention_pallas
from nanojax.models.llama import DecoderLayer, LlamaForCausalLM
from nanojax.pipeline.plan import OP_GROUPS, PlanError, ablation, check_model, validate

_PRODUCER = {"attention": "qkv", "o_proj": "attention", "mlp": "o_proj"}


def _check_order(plan: dict) -> None:
    """Each nano-op must come after the nano-ops that produce its inputs."""
    nb = plan["nano_batches"]
    done: set = set()
    last_attention = -1
    for op in plan["nano_ops"]:
        g, k = op["op"], op["batch"]
        a, b = nb[g][k]
        if g in _PRODUCER:
            p = _PRODUCER[g]
            need = {(p, j) for j, (c, d) in enumerate(nb[p]) if c < b and a < d}
            if not need <= done:
                raise PlanError(f"nano-op {g}[{k}] is ordered before its inputs "
                                f"{sorted(need - done)}")
        if g == "attention":
            if k < last_attention:
                raise PlanError("attention nano-ops must run in token order")
            last_attention = k
        done.add((g, k))


def _streams_enabled() -> bool:
    return jax.default_backend() == "gpu" and os.environ.get("NANOJAX_STREAMS", "1") != "0"


def on_stream(fn, stream: int):
    """Place fn on an XLA execution stream (GPU only). jax 0.10 spells the function form
    `compute_on2(f, ...)`, jax 0.11 `compute_on(f, ...)`. The region must be flat: no
    nested jit inside (XLA: "No ExecutionStreamId found for call-start")."""
    if stream == 0 or not _streams_enabled():
        return fn
    import jax.experimental.compute_on as co
    from jax._src import core
    annotate = getattr(co, "compute_on2", None) or co.compute_on

    def placed(*args):
        spaces = jax.tree_util.tree_map(lambda _: core.MemorySpace.Device,
                                        jax.eval_shape(fn, *args))
        return annotate(fn, compute_type=f"gpu_stream:{stream}",
                        out_memory_spaces=spaces)(*args)
    return placed


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


class PipelineForward(UnrolledForward):
    """The Forward interface (see engine/forward.py) driven by a plan."""

    def __init__(self, cfg: ModelConfig, plan: dict, mode: str = "overlap", attention=None,
                 num_sms: int = 132, ctas_per_sm: int = 4):
        validate(plan)
        check_model(plan, cfg)
        self.plan = ablation(plan, mode)
        _check_order(self.plan)
        self.mode = mode
        if attention is None:
            attention = default_forward(cfg).attention
        super().__init__(cfg, attention)
        self.num_sms, self.ctas_per_sm = num_sms, ctas_per_sm

    def _attention_for(self, share: float):
        if self.attention is paged_attention_pallas and share < 1.0:
            programs = max(1, round(share * self.num_sms * self.ctas_per_sm))
            return functools.partial(paged_attention_pallas, num_programs=programs)
        return self.attention

    def __call__(self, params, tokens, kv, meta: PagedMetadata, logit_idx):
        t = tokens.shape[0]
        ranges = {g: _clip(self.plan["nano_batches"][g], t) for g in OP_GROUPS}
        ops = [op for op in self.plan["nano_ops"]
               if op["batch"] < len(ranges[op["op"]])]
        model, layer = self.model, DecoderLayer(self.cfg)
        inv_freq = model.inv_freq
        x = model.apply(params, tokens, method=LlamaForCausalLM.embed_tokens)
        new_kv = []
        for li, kv_layer in enumerate(kv):
            lp = {"params": params["params"][f"layers_{li}"]}
            out = {g: {} for g in OP_GROUPS}
            for op in ops:
                g, k = op["op"], op["batch"]
                a, b = ranges[g][k]
                stream = op.get("stream", 0)
                if g == "qkv":
                    f = lambda xs: layer.apply(lp, xs, method=DecoderLayer.qkv)  # noqa: E731
                    out[g][k] = on_stream(f, stream)(x[a:b])
                elif g == "attention":
                    q, kk, vv = _gather(out["qkv"], ranges["qkv"], a, b)
                    m = dataclasses.replace(meta, positions=meta.positions[a:b],
                                            slot_mapping=meta.slot_mapping[a:b],
                                            seq_ids=meta.seq_ids[a:b])
                    attend = self._attention_for(float(op.get("share", 1.0)))
                    f = lambda q, kk, vv, kvl, m: attend(q, kk, vv, kvl, m, inv_freq)  # noqa
                    out[g][k], kv_layer = on_stream(f, stream)(q, kk, vv, kv_layer, m)
                elif g == "o_proj":
                    attn = _gather(out["attention"], ranges["attention"], a, b)
                    f = lambda o, r: layer.apply(lp, o, r, method=DecoderLayer.attn_out)  # noqa
                    out[g][k] = on_stream(f, stream)(attn, x[a:b])
                else:
                    h = _gather(out["o_proj"], ranges["o_proj"], a, b)
                    f = lambda h: layer.apply(lp, h, method=DecoderLayer.mlp)  # noqa: E731
                    out[g][k] = on_stream(f, stream)(h)
            x = _gather(out["mlp"], ranges["mlp"], 0, t)
            new_kv.append(kv_layer)
        return model.apply(params, x[logit_idx], method=LlamaForCausalLM.logits), new_kv
