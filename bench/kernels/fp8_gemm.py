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


def torch_rates(m: int, k: int, n: int, iters: int, reps: int) -> dict:
    import torch
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x8, w8 = x.to(torch.float8_e4m3fn), (w / 0.02).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    sa = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5
    sb = torch.rand(1, n, device="cuda", dtype=torch.float32) + 0.5
    flop = 2.0 * m * k * n
    out = {"torch_bf16": best_rate(lambda: x @ w.t(), flop, sync, iters, reps),
           "torch_scaled_mm_tensor": best_rate(
               lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16), flop, sync, iters, reps)}
    try:
        out["torch_scaled_mm_rowwise"] = best_rate(
            lambda: torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb,
                                     out_dtype=torch.bfloat16), flop, sync, iters, reps)
    except Exception as e:  # noqa: BLE001 - older torch: row-wise scales unsupported
        out["torch_scaled_mm_rowwise"] = f"{type(e).__name__}: {str(e)[:200]}"
    del x, w, x8, w8
    torch.cuda.empty_cache()
    return out


def jax_rates(m: int, k: int, n: int, iters: int, reps: int) -> dict:
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
    out = {"jax_bf16": best_rate(lambda: dense(x, kernel), flop, sync, iters, reps),
           "jax_fp8_gemm": best_rate(lambda: gemm(x8, w8), flop, sync, iters, reps),
           "jax_fp8_gemm_scaled": best_rate(lambda: scaled(x8, w8, sx, sw), flop, sync,
                                            iters, reps),
           "jax_fp8_linear": best_rate(lambda: linear(x, w8, sw), flop, sync, iters, reps)}
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
           "iters": args.iters, "reps": args.reps, "jax": jax.__version__,
           "device": jax.devices()[0].device_kind,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "shapes": {}}
    for name in args.shapes:
        k, n = SHAPES[name]
        row = {"K": k, "N": n}
        try:
            row.update(torch_rates(args.tokens, k, n, args.iters, args.reps))
        except Exception as e:  # noqa: BLE001 - no torch / no CUDA torch: JAX alone
            row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row.update(jax_rates(args.tokens, k, n, args.iters, args.reps))
        for ours in ("jax_fp8_gemm", "jax_fp8_gemm_scaled", "jax_fp8_linear"):
            for peer in ("torch_scaled_mm_tensor", "torch_scaled_mm_rowwise"):
                if isinstance(row.get(peer), float):
                    row[f"{ours}_over_{peer}"] = row[ours] / row[peer]
        row["jax_fp8_linear_over_jax_bf16"] = row["jax_fp8_linear"] / row["jax_bf16"]
        res["shapes"][name] = row
        print(name, json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps them
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
