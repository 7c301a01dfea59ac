"""GPU benchmark: nanojax's FP8 projection (nanojax/layers/fp8.py) against
torch._scaled_mm at the LLaMA-3-8B projection shapes, torch and JAX in one process.

    PYTHONPATH=. python3 bench/kernels/fp8_gemm.py --out fp8_gemm.json [--tokens 2048]

Per shape (M tokens x K -> N): torch bf16, torch._scaled_mm with per-tensor scales and
with row-wise scales (per token x per channel, bf16 out: what our projection computes),
JAX bf16, our FP8 GEMM alone (fp8_matmul), the GEMM with its two scale vectors applied
(the projection less the activation quantization), and the whole projection
(fp8_linear: quantize per token, GEMM, rescale). Each rate: `--iters` calls queued, one
wait, best of `--reps`. Also the custom calls XLA compiled our GEMM to (the FP8 cuBLASLt
call is `__cublas$lt$matmul$f8`) and the projection's error against its float32
reference. JAX is told not to preallocate, so torch has room beside it.

Queued calls time the host's dispatch too: a jitted JAX call costs the host more than a
torch op, and below ~100 us of GPU work (q, o, k/v at 2,048 tokens) the queue runs dry
and the wall rate is the host's. So each GEMM is also timed on the device: the `*_kernel`
rates sum the kernels' own durations over `--iters` calls, from torch's profiler and
from jax's (nanojax/profiling/timeline.py), and the `*_kernel_over_*` ratios compare
those.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# the LLaMA-3-8B projections: name -> (K, N); qkv / gate_up are the merged forms
SHAPES = {"q": (4096, 4096), "kv": (4096, 1024), "qkv": (4096, 6144), "o": (4096, 4096),
          "gate": (4096, 14336), "gate_up": (4096, 28672), "down": (14336, 4096)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", choices=("jax", "torch"), default="jax",
                   help="whose kernels to time on the device: one profiler a process (CUPTI "
                        "takes one subscriber, and torch's keeps it); run the script "
                        "once each and compare the two files' *_kernel rates")
    args = p.parse_args(argv)
    args.shapes = args.shapes.split(",")
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad or args.tokens <= 0:
        p.error(f"unknown shapes {bad} (known: {', '.join(SHAPES)}) or tokens <= 0")
    return args


def best_rate(fn, flop: float, sync, iters: int, reps: int) -> float:
    """TFLOP/s of `fn()` queued `iters` times then synced, best of `reps`."""
    sync(fn())
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn()
        sync(out)
        best = max(best, flop * iters / (time.perf_counter() - t) / 1e12)
    return best


def torch_kernel_rate(fn, flop: float, iters: int) -> float:
    """TFLOP/s of `fn()` over its CUDA kernels' summed durations (torch's profiler)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == DeviceType.CUDA)
    return flop * iters / (us * 1e-6) / 1e12


def jax_kernel_rate(fn, flop: float, iters: int) -> tuple[float, list[str]]:
    """TFLOP/s of `fn()` over its device kernels' summed durations (jax's profiler), and
    the kernels' names."""
    from nanojax.profiling.timeline import capture
    fn().block_until_ready()

    def run():
        for _ in range(iters):
            out = fn()
        out.block_until_ready()
    events = capture(run)
    us = sum(e["dur_us"] for e in events)
    return flop * iters / (us * 1e-6) / 1e12, sorted({e["name"] for e in events})


def torch_rates(m: int, k: int, n: int, iters: int, reps: int, profile: bool) -> dict:
    import torch
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x8, w8 = x.to(torch.float8_e4m3fn), (w / 0.02).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    sa = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5
    sb = torch.rand(1, n, device="cuda", dtype=torch.float32) + 0.5
    flop = 2.0 * m * k * n
    fns = {"torch_bf16": lambda: x @ w.t(),
           "torch_scaled_mm_tensor": lambda: torch._scaled_mm(
               x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
           "torch_scaled_mm_rowwise": lambda: torch._scaled_mm(
               x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
    out: dict = {}
    for name, fn in fns.items():
        try:
            out[name] = best_rate(fn, flop, sync, iters, reps)
            if profile:
                out[f"{name}_kernel"] = torch_kernel_rate(fn, flop, iters)
        except Exception as e:  # noqa: BLE001 - older torch: row-wise scales unsupported
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    del x, w, x8, w8
    torch.cuda.empty_cache()
    return out


def jax_rates(m: int, k: int, n: int, iters: int, reps: int, profile: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from nanojax.layers.fp8 import (fp8_linear, fp8_matmul, quantize_activation,
                                    quantize_weight, reference_linear)
    bf = jnp.bfloat16
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(k1, (m, k), bf)
    kernel = jax.random.normal(k2, (k, n), bf) * 0.02
    w8, sw = quantize_weight(kernel)
    x8, sx = quantize_activation(x)
    sync = lambda o: o.block_until_ready()  # noqa: E731
    flop = 2.0 * m * k * n
    gemm = jax.jit(lambda a, b: fp8_matmul(a, b, bf))
    scaled = jax.jit(lambda a, b, s1, s2: (fp8_matmul(a, b, bf).astype(jnp.float32)
                                           * (s1 * s2)).astype(bf))
    linear = jax.jit(lambda a, b, s: fp8_linear(a, b, s, out_dtype=bf))
    dense = jax.jit(lambda a, b: jnp.dot(a, b))
    fns = {"jax_bf16": lambda: dense(x, kernel), "jax_fp8_gemm": lambda: gemm(x8, w8),
           "jax_fp8_gemm_scaled": lambda: scaled(x8, w8, sx, sw),
           "jax_fp8_linear": lambda: linear(x, w8, sw)}
    out: dict = {}
    for name, fn in fns.items():
        out[name] = best_rate(fn, flop, sync, iters, reps)
        if profile:
            out[f"{name}_kernel"], out[f"{name}_kernels"] = jax_kernel_rate(fn, flop, iters)
    txt = gemm.lower(x8, w8).compile().as_text()
    out["custom_calls"] = sorted({ln.split('custom_call_target="')[1].split('"')[0]
                                  for ln in txt.splitlines() if 'custom_call_target="' in ln})
    ref = reference_linear(x, w8, sw)
    got = linear(x, w8, sw).astype(jnp.float32)
    out["rel_err_vs_f32_reference"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    exact = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
    out["rel_err_vs_unquantized"] = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    res = {"command": "python3 " + " ".join(sys.argv), "tokens": args.tokens,
           "iters": args.iters, "reps": args.reps, "profile": args.profile, "jax": jax.__version__,
           "device": jax.devices()[0].device_kind,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "shapes": {}}
    for name in args.shapes:
        k, n = SHAPES[name]
        row = {"K": k, "N": n}
        try:
            row.update(torch_rates(args.tokens, k, n, args.iters, args.reps,
                                   args.profile == "torch"))
        except Exception as e:  # noqa: BLE001 - no torch / no CUDA torch: JAX alone
            row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row.update(jax_rates(args.tokens, k, n, args.iters, args.reps, args.profile == "jax"))
        for ours in ("jax_fp8_gemm", "jax_fp8_gemm_scaled", "jax_fp8_linear"):
            for peer in ("torch_scaled_mm_tensor", "torch_scaled_mm_rowwise"):
                for t in ("", "_kernel"):  # wall rates, and kernel time against kernel time
                    if isinstance(row.get(peer + t), float) and ours + t in row:
                        row[f"{ours}{t}_over_{peer}{t}"] = row[ours + t] / row[peer + t]
        row["jax_fp8_linear_over_jax_bf16"] = row["jax_fp8_linear"] / row["jax_bf16"]
        res["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps them
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
