"""A plan's fused GEMM + decode-attention pair at run time (plan.py: the "fused" field).

The pair runs as one launch of pallas_kernels/fused_gemm_attention_mgpu.py: programs
[0, G) one GEMM of the GEMM nano-op, the rest the attention nano-op's decode attention.
A GEMM nano-op holds several GEMMs (qkv: q, k, v; mlp: gate, up, down), so the launch
takes the op's first GEMM whose operands the kernel tiles (q_proj, o_proj, gate_proj on
LLaMA); the op's other GEMMs and its norms run as they always do. The attention side is
the Pallas attend path with the fused launch in place of its decode kernel (RoPE on q, the
page-table rows and the chunked-prefill kernel unchanged), after the nano-op's append,
so the append-then-attend contract of the executor holds.

Where the launch cannot run, the two nano-ops run one after the other through the same
math (the nanobatch-only mode's), and the reason is kept: `unavailable` (device, backend,
decode kernel), or no GEMM of the op that the kernel takes (`PairMatmul.why`).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from nanojax.layers.attention import AttentionBackend, choose_decode_kernel
from nanojax.layers.kv_fp8 import is_fp8, kv_parts
from pallas_kernels.device import device_sms


def unavailable(attention: AttentionBackend, pair: dict, q, kv_layer,
                hopper: bool | None = None, sms: int | None = None) -> str | None:
    """Why this pair cannot be one launch here (None: it can, if a GEMM fits). The decode
    kernel is the one the backend's attend would pick. hopper, sms: the device's (tests;
    None: asked)."""
    if hopper is None:
        from pallas_kernels.mosaic_gpu_support import on_hopper
        hopper = on_hopper()
    if not hopper:
        return f"no Hopper GPU ({jax.default_backend()}): the fused kernel is Mosaic GPU"
    if attention.decode_kernel is None:
        return "the attention backend is not the Pallas one (attend_pallas)"
    kernel = choose_decode_kernel(attention.decode_kernel, q, kv_parts(kv_layer)[0])
    if kernel != "mosaic":
        return f"the decode kernel is {kernel}, not the swap-AB Mosaic GPU one"
    if is_fp8(kv_parts(kv_layer)[0].dtype):  # the fused launch passes no page scales
        return "FP8 pages: the fused launch takes 16-bit pages"
    sms = device_sms() if sms is None else sms
    if pair["programs"] > sms:
        return f"the plan's launch has {pair['programs']} programs, the device {sms} SMs"
    return None


class PairMatmul:
    """A DecoderLayer's matmul for the GEMM side of a fused pair: its first call whose
    operands the kernel takes is the fused launch (the attention's output is kept in
    `attention_out`); every other call is `base` (None: jnp.dot). `why`: why no call was
    fused (the last refusal), when none was."""

    def __init__(self, attend_with: Callable, q, kv_layer, meta, inv_freq, *,
                 gemm_programs: int, programs: int, base: Callable | None = None):
        self.attend_with, self.q, self.kv_layer = attend_with, q, kv_layer
        self.meta, self.inv_freq = meta, inv_freq
        self.gemm_programs, self.programs = gemm_programs, programs
        self.base = base or jnp.dot
        self.attention_out: jax.Array | None = None
        self.why: str | None = "the GEMM nano-op ran no GEMM"

    def __call__(self, x, w):
        from pallas_kernels.fused_gemm_attention_mgpu import (fused_gemm_attention,
                                                              unsupported)
        if self.attention_out is not None:
            return self.base(x, w)
        why = unsupported(x, w, self.q, kv_parts(self.kv_layer)[0],
                          gemm_programs=self.gemm_programs, num_programs=self.programs)
        if why is not None:
            self.why = f"no GEMM of the nano-op fits the fused kernel ({why})"
            return self.base(x, w)
        gemm = {}

        def decode(q, k_pages, v_pages, rows, lens, num_programs=None, interpret=False):
            gemm["out"], o = fused_gemm_attention(
                x, w, q, k_pages, v_pages, rows, lens, gemm_programs=self.gemm_programs,
                num_programs=self.programs, interpret=interpret)
            return o
        self.attention_out = self.attend_with(decode)(self.q, self.kv_layer, self.meta,
                                                      self.inv_freq)
        self.why = None
        return gemm["out"]
