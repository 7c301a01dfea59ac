"""Resource shares come from the SM count of the device the step runs on
(pallas_kernels/device.py), not the H200's: on a fake A100 (108 SMs) the executor, the
fused-pair check and the profiler divide 108 SMs."""
import types

import jax
import jax.numpy as jnp
import pytest

from nanojax.config import KernelConfig, named_shape
from nanojax.layers.attention import (PagedAttention, PagedMetadata, attend_cpu,
                                      decode_programs)
from nanojax.pipeline.executor import PipelineForward
from nanojax.pipeline.plan import validate
from pallas_kernels import device as device_mod
from pallas_kernels.device import FALLBACK_SMS, device_sms

A100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                             core_count=108)


@pytest.fixture
def on_a100(monkeypatch):
    """jax's first device, as device_sms sees it, is an A100."""
    monkeypatch.setattr(device_mod, "jax", types.SimpleNamespace(devices=lambda: [A100]))


def test_device_sms_reads_the_device_and_falls_back_only_where_it_says_nothing():
    assert device_sms(A100) == 108
    assert device_sms(types.SimpleNamespace(platform="gpu", core_count=114)) == 114
    cpu = jax.devices("cpu")[0]
    assert not hasattr(cpu, "core_count") or not cpu.core_count
    assert device_sms(cpu) == FALLBACK_SMS == 132


def _plan(cfg, b_dense=32):
    return validate({
        "version": 1, "model": cfg.signature(), "tp": 1, "b_dense": b_dense,
        "nano_batches": {g: [[0, 16], [16, b_dense]]
                         for g in ("qkv", "attention", "o_proj", "mlp")},
        "nano_ops": [{"op": "qkv", "batch": 0}, {"op": "qkv", "batch": 1},
                     {"op": "attention", "batch": 0, "stream": 1, "share": 0.5},
                     {"op": "o_proj", "batch": 0},
                     {"op": "mlp", "batch": 0, "stream": 2, "share": 0.25},
                     {"op": "attention", "batch": 1, "stream": 1, "share": 0.75},
                     {"op": "o_proj", "batch": 1}, {"op": "mlp", "batch": 1}]})


def test_the_executors_shares_divide_the_devices_sms(on_a100, monkeypatch):
    """PipelineForward built as the engine builds it (no num_sms): each attention nano-op's
    bounded grid and each GEMM nano-op's program count come from 108 SMs."""
    from nanojax.models.llama import init_params
    from nanojax.pipeline import executor
    grids, gemms = [], []

    def attend(q, kv_layer, meta, inv_freq, share=None, num_sms=None, ctas_per_sm=4):
        grids.append((decode_programs("mosaic", share, num_sms),
                      decode_programs("triton", share, num_sms, ctas_per_sm)))
        return attend_cpu(q, kv_layer, meta, inv_freq)

    def matmul_at(share, num_sms, enabled=False, interpret=False):
        gemms.append(max(1, round(share * num_sms)))
        return None  # the layers' own dot
    monkeypatch.setattr(executor, "matmul_at", matmul_at)

    cfg = named_shape("tiny")
    backend = PagedAttention(attend, width_free=True, decode_kernel="mosaic")
    fwd = PipelineForward(cfg, _plan(cfg), "overlap", kernels=KernelConfig(),
                          attention=backend)
    assert fwd.num_sms == 108
    t, pages, ps = 32, 16, 4
    sd = jax.ShapeDtypeStruct
    i32 = sd((t,), jnp.int32)
    meta = PagedMetadata(i32, i32, i32, sd((t, 4), jnp.int32), i32, sd((), jnp.int32))
    params = jax.eval_shape(lambda: init_params(cfg))
    kv = jax.eval_shape(lambda: fwd.init_kv(pages, ps))
    jax.eval_shape(fwd.__call__, params, sd((t,), jnp.int32), kv, meta, sd((2,), jnp.int32))
    # per layer: attention at 0.5 (54 of 108 SMs; 216 Triton programs at 4 an SM) and 0.75
    assert set(grids) == {(54, 216), (81, 324)}  # 132 SMs: (66, 264) and (99, 396)
    assert set(gemms) == {27, 108}  # mlp[0] at 0.25, the rest at 1.0


def test_a_fused_pair_wider_than_the_device_is_refused(on_a100):
    """fused.unavailable asks the device (108 SMs) when the test pins no count."""
    from nanojax.layers.attention import pallas_backend
    from nanojax.pipeline.fused import unavailable
    pair = {"gemm_programs": 88, "programs": 132}
    q = jnp.zeros((4, 32, 128), jnp.bfloat16)
    kv = (jnp.zeros((8, 8, 16, 128), jnp.bfloat16),) * 2
    pallas = pallas_backend(KernelConfig(decode_kernel="mosaic"))
    assert "132 programs, the device 108 SMs" in unavailable(pallas, pair, q, kv,
                                                             hopper=True)
    assert unavailable(pallas, {"gemm_programs": 72, "programs": 108}, q, kv,
                       hopper=True) is None


def test_the_profilers_attention_shares_divide_the_devices_sms(on_a100):
    from checkpoints.loader import load_model
    from search.profiler import LayerOps
    lay = LayerOps(load_model("random:tiny"), 32, 16, "24/16", num_pages=256)
    assert lay.num_sms == 108
