"""The per-iteration model forward, behind one small interface the runner calls.

    prepare(params)              -> parameters as this forward wants them on device
    layout(params, stack)        -> the parameter tree restructured as prepare() places it
    init_kv(num_pages, page_size) -> the paged KV cache in this forward's layout
    __call__(params, tokens, kv, meta, logit_idx) -> (logits [R, V] f32, kv)
    for_shard(cfg, tp_axis)      -> this forward for one tensor-parallel shard (parallel/tp.py)

`ScanForward` stacks the layers and runs them with lax.scan: one layer is compiled once,
so compiles stay short on the CPU. `UnrolledForward` runs the layers as straight-line
code, which is what stream annotation and the nano-batch executor need on the GPU.
"""
from __future__ import annotations

import copy

import jax
import jax.numpy as jnp

from nanojax.config import ModelConfig
from nanojax.engine.kv_cache import init_kv_pages
from nanojax.layers.attention import paged_attention, paged_attention_pallas
from nanojax.models.llama import DecoderLayer, LlamaForCausalLM


class UnrolledForward:
    # tp_axis: run as one tensor-parallel shard inside shard_map (nanojax/parallel/tp.py);
    # cfg is then the shard's shape
    def __init__(self, cfg: ModelConfig, attention=paged_attention, tp_axis: str | None = None):
        self.cfg = cfg
        self.attention = attention
        self.tp_axis = tp_axis
        self.model = LlamaForCausalLM(cfg, tp_axis=tp_axis)

    def layer(self, matmul=None) -> DecoderLayer:
        return DecoderLayer(self.cfg, matmul=matmul, reduce=self.model.reduce)

    def layout(self, params, stack=jnp.stack):
        return params

    def for_shard(self, cfg: ModelConfig, tp_axis: str):
        """This forward for one tensor-parallel shard of shape cfg (inside shard_map)."""
        new = copy.copy(self)
        new.cfg, new.tp_axis = cfg, tp_axis
        new.model = LlamaForCausalLM(cfg, tp_axis=tp_axis)
        return new

    def prepare(self, params):
        return jax.device_put(self.layout(params))

    def init_kv(self, num_pages: int, page_size: int):
        return init_kv_pages(self.cfg, num_pages, page_size)

    def __call__(self, params, tokens, kv, meta, logit_idx):
        return self.model.apply(params, tokens, kv, meta, self.attention,
                                logit_indices=logit_idx)


class ScanForward(UnrolledForward):
    def layout(self, params, stack=jnp.stack):
        p = dict(params["params"])
        layers = [p.pop(f"layers_{i}") for i in range(self.cfg.num_layers)]
        stacked = jax.tree_util.tree_map(lambda *xs: stack(xs), *layers)
        return {"rest": {"params": p}, "layers": stacked}

    def init_kv(self, num_pages: int, page_size: int):
        c = self.cfg
        shape = (c.num_layers, num_pages, c.num_kv_heads, page_size, c.head_dim)
        make = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(c.dtype)))
        return make(), make()

    def __call__(self, params, tokens, kv, meta, logit_idx):
        model, layer, inv_freq = self.model, self.layer(), self.model.inv_freq
        rest = params["rest"]
        x = model.apply(rest, tokens, method=LlamaForCausalLM.embed_tokens)

        def body(x, xs):
            layer_params, k, v = xs
            x, (k, v) = layer.apply({"params": layer_params}, x, (k, v), meta,
                                    self.attention, inv_freq)
            return x, (k, v)

        x, kv = jax.lax.scan(body, x, (params["layers"], *kv))
        return model.apply(rest, x[logit_idx], method=LlamaForCausalLM.logits), kv


def default_forward(cfg: ModelConfig):
    """GPU: straight-line layers with the Pallas attention kernel; CPU: scan, pure JAX."""
    if jax.default_backend() == "gpu":
        return UnrolledForward(cfg, attention=paged_attention_pallas)
    return ScanForward(cfg)
