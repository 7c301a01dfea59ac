"""LLaMA-family decoder in Flax (LLaMA 2/3, SmolLM2, Qwen2, Qwen3; Mixtral, Qwen2-MoE and
Qwen3-MoE with the MoE block of models/moe.py as the MLP).

Tokens are packed flat ([T], no batch axis), as a serving engine feeds them. A layer is
split into the ops NanoFlow schedules separately (qkv projection, attention, output
projection, MLP), each a method, so an executor can run them on nano-batches. Weights are
stored [in, out], so q/k/v/gate/up shard by columns and o/down by rows under tensor
parallelism.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from nanojax.config import ModelConfig
from nanojax.layers.fp8 import QuantizedActivation
from nanojax.layers.linear import Linear, RMSNorm
from nanojax.layers.quant import quantized_dot
from nanojax.layers.rotary import inverse_frequencies
from nanojax.models.moe import MoEBlock


def _dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    matmul: Callable | None = None  # every projection's GEMM (None: jnp.dot)
    # tensor parallelism: sums the row-parallel o/down partial outputs over the shards
    # (one collective per block); None: one device, nothing to sum
    reduce: Callable | None = None
    grouped_gemm: str = "auto"  # an MoE FFN's expert GEMMs (KernelConfig.grouped_gemm)
    act_quant: str = "xla"  # FP8 projections' input quantization (KernelConfig.act_quant)

    def setup(self):
        c, dt = self.cfg, _dtype(self.cfg)
        # every dense projection: the model dtype's GEMM (at a share) or FP8 (config)
        proj = functools.partial(Linear, dtype=dt, matmul=self.matmul,
                                 quantization=c.quantization,
                                 static_input_scale=c.activation_scale == "static")
        self.input_norm = RMSNorm(c.rms_norm_eps, dt)
        self.q_proj = proj(c.q_size, use_bias=c.attention_bias)
        self.k_proj = proj(c.kv_size, use_bias=c.attention_bias)
        self.v_proj = proj(c.kv_size, use_bias=c.attention_bias)
        self.o_proj = proj(c.hidden_size)
        if c.qk_norm:  # Qwen3: one [head_dim] scale each, shared by the heads (TP: whole)
            self.q_norm = RMSNorm(c.rms_norm_eps, dt)
            self.k_norm = RMSNorm(c.rms_norm_eps, dt)
        self.post_attention_norm = RMSNorm(c.rms_norm_eps, dt)
        if c.is_moe:  # Mixtral / Qwen2-MoE: a routed mixture of experts is the FFN
            self.moe = MoEBlock(c, self.matmul, self.grouped_gemm)
        else:
            self.gate_proj = proj(c.intermediate_size)
            self.up_proj = proj(c.intermediate_size)
            self.down_proj = proj(c.hidden_size)

    def qkv(self, x):
        """[T, hidden] -> q [T, H, D], k, v [T, KVH, D] (unrotated)."""
        c = self.cfg
        h = self.input_norm(x, quantize=self._fused_quant(c.hidden_size))
        t = x.shape[0]
        q = self.q_proj(h).reshape(t, c.num_heads, c.head_dim)
        k = self.k_proj(h).reshape(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self.v_proj(h).reshape(t, c.num_kv_heads, c.head_dim)

    def _reduce(self, y):
        return y if self.reduce is None else self.reduce(y)

    def attn_out(self, attn, residual):
        return residual + self._reduce(self.attn_out_partial(attn))

    def attn_out_partial(self, attn):
        """The output projection before the sum over TP shards."""
        x = attn.reshape(attn.shape[0], -1)
        if self._fused_quant(x.shape[1]):  # no producer to fuse into: one pass, not XLA's two
            from pallas_kernels.act_quant import quantize_rows
            x = QuantizedActivation(*quantize_rows(
                x, interpret=jax.default_backend() != "gpu"))
        return self.o_proj(x)

    def mlp(self, x):
        return x + self._reduce(self.mlp_partial(x))

    def mlp_partial(self, x):
        """The MLP without its residual, before the sum over TP shards."""
        c = self.cfg
        if c.is_moe:
            return self.moe(self.post_attention_norm(x))
        h = self.post_attention_norm(x, quantize=self._fused_quant(c.hidden_size))
        if self._fused_quant(c.intermediate_size):
            # gate and up dequantized inside the kernel, not each in a pass of XLA's
            from pallas_kernels.act_quant import silu_mul_quant
            gate, up = self.gate_proj(h, unscaled=True), self.up_proj(h, unscaled=True)
            return self.down_proj(QuantizedActivation(*silu_mul_quant(
                gate.values, up.values, (gate.row_scale, gate.col_scale, up.col_scale),
                interpret=jax.default_backend() != "gpu")))
        return self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))

    def _fused_quant(self, width: int) -> bool:
        """Whether an FP8 projection's input of this width is quantized by its producer's
        fused kernel (act_quant "pallas"; "auto": on a GPU) rather than by XLA after it."""
        c, mode = self.cfg, self.act_quant
        if (mode == "xla" or c.quantization != "fp8" or c.activation_scale == "static"
                or (mode == "auto" and jax.default_backend() != "gpu")):
            return False
        from pallas_kernels.act_quant import unsupported
        return unsupported(width) is None

    def __call__(self, x, kv_layer, meta, attention, inv_freq):
        q, k, v = self.qkv(x)
        o, kv_layer = attention(q, k, v, kv_layer, meta, inv_freq)
        return self.mlp(self.attn_out(o, x)), kv_layer


class LlamaForCausalLM(nn.Module):
    cfg: ModelConfig
    # tensor parallelism (inside shard_map): the mesh axis the shards sit on. cfg is then
    # one shard's shape; the embedding holds a contiguous slice of the vocabulary and
    # logits() returns that slice's logits (nanojax/parallel/tp.py)
    tp_axis: str | None = None
    grouped_gemm: str = "auto"  # the layers' KernelConfig.grouped_gemm
    act_quant: str = "xla"  # the layers' KernelConfig.act_quant

    def setup(self):
        c, dt = self.cfg, _dtype(self.cfg)
        self.embed = nn.Embed(c.vocab_size, c.hidden_size, param_dtype=dt, dtype=dt,
                              embedding_init=nn.initializers.normal(0.02))
        self.layers = [DecoderLayer(c, reduce=self.reduce, grouped_gemm=self.grouped_gemm,
                                    act_quant=self.act_quant) for _ in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, dt)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, dt, out_dtype=jnp.float32)

    @property
    def inv_freq(self) -> np.ndarray:
        return inverse_frequencies(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    @property
    def reduce(self):
        if self.tp_axis is None:
            return None
        return lambda y: jax.lax.psum(y, self.tp_axis)

    def embed_tokens(self, tokens):
        if self.tp_axis is None:
            return self.embed(tokens)
        # vocab-parallel: each shard looks up the ids in its slice, zeros elsewhere; a sum
        local = tokens - jax.lax.axis_index(self.tp_axis) * self.cfg.vocab_size
        mine = (local >= 0) & (local < self.cfg.vocab_size)
        x = self.embed(jnp.where(mine, local, 0))
        return self.reduce(jnp.where(mine[:, None], x, jnp.zeros_like(x)))

    def logits(self, x):
        """Final norm and LM head; logits are f32."""
        x = self.norm(x)
        if self.cfg.tie_word_embeddings and self.has_variable("quant", "tied_embed"):
            # the tied embedding block-quantized (layers/quant.py), passed for few rows
            return quantized_dot(x, self.get_variable("quant", "tied_embed"))
        if self.cfg.tie_word_embeddings:
            w = self.embed.embedding
            return jnp.dot(x, w.T, preferred_element_type=jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def __call__(self, tokens, kv_caches, meta, attention, logit_indices=None):
        """tokens [T] -> (logits [T or len(logit_indices), V] f32, new kv_caches)."""
        x = self.embed_tokens(tokens)
        inv_freq = self.inv_freq
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, kv, meta, attention, inv_freq)
            new_caches.append(kv)
        if logit_indices is not None:
            x = x[logit_indices]
        return self.logits(x), new_caches


def _dummy_call(cfg: ModelConfig):
    """Arguments for tracing init: one token, a one-slot contiguous cache."""
    from nanojax.layers.attention import ContiguousMetadata, contiguous_attention
    dt = _dtype(cfg)
    kv = [(jnp.zeros((1, cfg.num_kv_heads, cfg.head_dim), dt),) * 2
          for _ in range(cfg.num_layers)]
    meta = ContiguousMetadata(positions=jnp.zeros((1,), jnp.int32))
    return jnp.zeros((1,), jnp.int32), kv, meta, contiguous_attention


def param_shapes(cfg: ModelConfig):
    """The parameter tree as ShapeDtypeStructs, without allocating anything."""
    model = LlamaForCausalLM(cfg)
    return jax.eval_shape(lambda r: model.init(r, *_dummy_call(cfg)), jax.random.PRNGKey(0))


def init_params(cfg: ModelConfig, seed: int = 0, shardings=None):
    """Random weights (normal, std 0.02; norms at 1) for shape-only runs, made on device;
    with shardings (a tree like param_shapes'), each device makes only its shards. A
    quantized config gets the float model's weights quantized (the same values as
    quantizing at load), inside the same jit."""
    from nanojax.layers.fp8 import quantize_params
    float_cfg = cfg.replace(quantization=None, activation_scale="dynamic")
    model = LlamaForCausalLM(float_cfg)

    def make(rng):
        params = model.init(rng, *_dummy_call(float_cfg))
        if cfg.quantization:
            params = quantize_params(params, cfg.activation_scale == "static",
                                     blocks=cfg.quantization == "fp8-block")
        return params
    return jax.jit(make, out_shardings=shardings)(jax.random.PRNGKey(seed))
