"""The dense building blocks of the decoder: RMSNorm and a Linear whose GEMM can be swapped
(layers/matmul.py gives a GEMM at a resource share) or quantized (layers/fp8.py)."""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from nanojax.layers.fp8 import (FP8, WEIGHT_BLOCK, QuantizedActivation, fp8_block_linear,
                                fp8_gemm, fp8_linear)
from nanojax.layers.quant import quantized_dot


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, quantize: bool = False):
        """quantize: the output as FP8 projections take it, normalized and quantized per
        token in one fused kernel (pallas_kernels/act_quant.py; interpreted off the GPU)."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if quantize:
            from pallas_kernels.act_quant import rms_norm_quant
            return QuantizedActivation(*rms_norm_quant(
                x, scale, self.eps, interpret=jax.default_backend() != "gpu"))
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale * y.astype(self.dtype)


class Linear(nn.Module):
    features: int
    dtype: jnp.dtype
    use_bias: bool = False
    matmul: Callable | None = None  # None: jnp.dot (layers/matmul.py: a GEMM at a share)
    # "fp8": e4m3 weight [out, in] + per-channel scales, FP8 activations (layers/fp8.py);
    # its GEMM is XLA's FP8 GEMM whatever `matmul` says; "fp8-block": scales per 128 x 128
    # block, the block-scaled GEMM
    quantization: str | None = None
    static_input_scale: bool = False  # fp8: the checkpoint's input_scale, not per token
    # the GEMM's output dtype where not the model's (the LM head's f32 logits: written by
    # the GEMM itself, not a bf16 output and a convert pass over [rows, vocab])
    out_dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x, unscaled: bool = False):
        """unscaled (quantization "fp8", no bias): the FP8 GEMM's output and the scales
        that dequantize it (layers/fp8.py's ScaledOutput), for a kernel that applies them."""
        if unscaled and (self.quantization != "fp8" or self.use_bias):
            raise ValueError("an unscaled output is an fp8 projection's without a bias")
        if self.quantization in ("fp8", "fp8-block"):
            return self._fp8(x, unscaled) if unscaled else self._bias(self._fp8(x))
        kernel = self.param("kernel", nn.initializers.normal(0.02),
                            (x.shape[-1], self.features), self.dtype)
        # output in the model dtype (GPUs accumulate bf16 GEMMs in f32 anyway): an f32
        # output plus a convert costs a separate kernel inside stream regions, where XLA
        # does not fold the convert into the GEMM (the H200 step's timeline:
        # bench/results/log/step.md)
        if self.has_variable("quant", "q"):
            # the same weight block-quantized (layers/quant.py): the forward passes it
            # for steps of few rows on the CPU; the f32 kernel goes unread there
            w: dict = {k: self.get_variable("quant", k) for k in ("q", "d", "m")
                 if self.has_variable("quant", k)}
            y = quantized_dot(x, w).astype(self.dtype)
        elif self.out_dtype is not None:
            assert self.matmul is None, "out_dtype is the plain GEMM's"
            y = jnp.dot(x.astype(self.dtype), kernel, preferred_element_type=self.out_dtype)
        else:
            y = (self.matmul or jnp.dot)(x.astype(self.dtype), kernel)
        return self._bias(y)

    def _fp8(self, x, unscaled: bool = False):
        # real weights arrive quantized (checkpoints/quantize.py); these inits only shape
        # the tree (random models are made in the float dtype, then quantized)
        width = (x.values if isinstance(x, QuantizedActivation) else x).shape[-1]
        weight = self.param("weight", nn.initializers.zeros, (self.features, width), FP8)
        if self.quantization == "fp8-block":
            blocks = (-(-self.features // WEIGHT_BLOCK), -(-width // WEIGHT_BLOCK))
            scales = self.param("weight_scale", nn.initializers.ones, blocks, jnp.float32)
            return fp8_block_linear(x, weight, scales, self.dtype)
        scale = self.param("weight_scale", nn.initializers.ones, (self.features,), jnp.float32)
        in_scale = (self.param("input_scale", nn.initializers.ones, (), jnp.float32)
                    if self.static_input_scale else None)
        if not isinstance(x, QuantizedActivation):
            x = x.astype(self.dtype)
        if unscaled:
            return fp8_gemm(x, weight, scale, in_scale, self.dtype)
        return fp8_linear(x, weight, scale, in_scale, self.dtype)

    def _bias(self, y):
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y
