"""The per-iteration model forward, behind one small interface the runner calls.

    prepare(params)              -> parameters as this forward wants them on device
    init_kv(num_pages, page_size, dtype=None) -> the paged KV cache in this forward's layout
                                  (dtype: the cache's element type; None: the model's)
    __call__(params, tokens, kv, meta, logit_idx) -> (logits [R, V] f32, kv)

`ScanForward` stacks the layers and runs them with lax.scan: one layer is compiled once,
so compiles stay short on the CPU. `UnrolledForward` runs the layers as straight-line
code, which is what stream annotation and the nano-batch executor need on the GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from nanojax.config import ModelConfig
from nanojax.engine.kv_cache import init_kv_pages
from nanojax.layers.kv_fp8 import init_kv_layer
from nanojax.layers.attention import paged_attention, paged_attention_pallas
from nanojax.models.llama import DecoderLayer, LlamaForCausalLM


class UnrolledForward:
    def __init__(self, cfg: ModelConfig, attention=paged_attention):
        self.cfg = cfg
        self.attention = attention
        self.model = LlamaForCausalLM(cfg)

    def prepare(self, params):
        return jax.device_put(params)

    def init_kv(self, num_pages: int, page_size: int, dtype=None):
        return init_kv_pages(self.cfg, num_pages, page_size, dtype=dtype)

    def __call__(self, params, tokens, kv, meta, logit_idx):
        return self.model.apply(params, tokens, kv, meta, self.attention,
                                logit_indices=logit_idx)


class ScanForward(UnrolledForward):
    def prepare(self, params):
        p = dict(params["params"])
        layers = [p.pop(f"layers_{i}") for i in range(self.cfg.num_layers)]
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
        return jax.device_put({"rest": {"params": p}, "layers": stacked})

    def init_kv(self, num_pages: int, page_size: int, dtype=None):
        c = self.cfg
        shape = (c.num_layers, num_pages, c.num_kv_heads, page_size, c.head_dim)
        return init_kv_layer(shape, dtype or c.dtype)  # every layer's, stacked

    def __call__(self, params, tokens, kv, meta, logit_idx):
        model, layer, inv_freq = self.model, DecoderLayer(self.cfg), self.model.inv_freq
        rest = params["rest"]
        x = model.apply(rest, tokens, method=LlamaForCausalLM.embed_tokens)

        def body(x, xs):
            layer_params, kv_layer = xs
            return layer.apply({"params": layer_params}, x, kv_layer, meta,
                               self.attention, inv_freq)

        x, kv = jax.lax.scan(body, x, (params["layers"], kv))
        return model.apply(rest, x[logit_idx], method=LlamaForCausalLM.logits), kv


def default_forward(cfg: ModelConfig):
    """GPU: straight-line layers with the Pallas attention kernel; CPU: scan, pure JAX."""
    if jax.default_backend() == "gpu":
        return UnrolledForward(cfg, attention=paged_attention_pallas)
    return ScanForward(cfg)
