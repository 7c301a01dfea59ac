"""GPU: the fused FP8 activation-quantization kernels (pallas_kernels/act_quant.py) against
their XLA references and the device's copy bandwidth, at a step's token counts, over their
launch's warps per program (and SiLU x up's one or two passes over a row), in one process;
and the attention output's quantization (quantize_rows, o's input) against XLA's.

    python bench/repro/kernels/act_quant_kernels.py OUT.json          # one GPU: ~1 minute
    python bench/repro/kernels/act_quant_kernels.py OUT.json --smoke  # CPU, interpret mode

Why: in an H100 engine profile (bench/results/log/fp8.md §91) SiLU x up + quantize took
44.6 us a layer at 1,024 tokens, 1.65 TB/s of the bytes it must move, about half the
card's copy rate; RMSNorm + quantize 5.2 us. Each row: the kernel, tokens, width, warps,
seconds, the bytes it must move (bf16 in, e4m3 and a scale a token out) over those seconds,
and that rate as a fraction of a copy measured in the same run. The reference rows are
the same computations as XLA fuses them (two passes: the absmax, then divide and convert).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
from bench_decode import copy_bandwidth  # noqa: E402  (shared with the decode sweeps)

HIDDEN, INTERMEDIATE = 4096, 14336  # LLaMA-3-8B's


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes in interpret mode (checks that the script runs)")
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--silu-warps", default="4,8,16,32")
    ap.add_argument("--rms-warps", default="2,4,8")
    ap.add_argument("--silu-chunks", default="",
                    help="SiLU x up's columns per piece of a row, comma-separated powers of 2 "
                         "(default: the kernel's, 2,048 at the 8B's width); one pass only")
    ap.add_argument("--quant-warps", default="2,4,8",
                    help="quantize_rows (o's input, the attention output) over warps")
    ap.add_argument("--silu-passes", default="1,2",
                    help="SiLU x up's passes over a row: 1 holds it in registers, 2 reads it "
                         "twice (silu_mul_quant's two_pass)")
    ap.add_argument("--rows", default="1",
                    help="rows a program, comma-separated powers of 2 (every kernel: one "
                         "[rows, piece] tile a piece; SiLU x up's column scales loaded once "
                         "for them)")
    args = ap.parse_args()
    from pallas_kernels.act_quant import (quantize_rows, quantize_rows_reference,
                                          rms_norm_quant, rms_norm_quant_reference,
                                          silu_mul_quant, silu_mul_quant_reference)
    from nanojax.profiling.timing import device_seconds

    smoke = args.smoke
    hidden, inter = (64, 128) if smoke else (HIDDEN, INTERMEDIATE)
    tokens = [4] if smoke else [int(t) for t in args.tokens.split(",")]
    timing = dict(iters=2, reps=1) if smoke else {}
    copy = None if smoke else copy_bandwidth()
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "copy_bytes_per_s": copy,
           "command": " ".join(sys.argv), "rows": []}

    def row(kernel, t, width, warps, fn, fn_args, nbytes, check=None, **extra):
        r = {"kernel": kernel, "tokens": t, "width": width, "num_warps": warps, **extra}
        try:
            out = jax.block_until_ready(jax.jit(fn)(*fn_args))
            if check is not None:  # e4m3 values within one rounding step, scales close
                q, s = out
                rq, rs = check
                r["max_scale_rel_diff"] = float(jnp.max(jnp.abs(s - rs) / rs))
                r["max_value_diff"] = float(jnp.max(jnp.abs(
                    q.astype(jnp.float32) - rq.astype(jnp.float32))))
            secs = device_seconds(fn, *fn_args, **timing)
            r.update(seconds=secs, bytes=nbytes, bytes_per_s=nbytes / secs)
            if copy:
                r["of_copy"] = nbytes / secs / copy
        except Exception as e:  # a launch variant that does not compile is a finding too
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["rows"].append(r)
        print(json.dumps(r), file=sys.stderr)

    row_counts = [int(x) for x in args.rows.split(",")]
    key = jax.random.PRNGKey(0)
    for t in tokens:
        gate = jax.random.normal(key, (t, inter), jnp.bfloat16)
        up = jax.random.normal(jax.random.fold_in(key, 1), (t, inter), jnp.bfloat16)
        scales = (jnp.full((t, 1), 0.02, jnp.float32),
                  jnp.full((inter,), 0.5, jnp.float32), jnp.full((inter,), 0.7, jnp.float32))
        moved = 2 * t * inter * 2 + t * inter + 4 * t  # bf16 in twice, e4m3 and a scale out
        ref = jax.jit(silu_mul_quant_reference)(gate, up, scales)
        row("silu_mul_quant_xla", t, inter, None, silu_mul_quant_reference,
            (gate, up, scales), moved)
        chunks = [int(x) for x in args.silu_chunks.split(",") if x] or [None]
        variants = [(p, c) for p in [int(x) for x in args.silu_passes.split(",")]
                    for c in (chunks if p == 1 else [None])]  # two passes: the kernel's chunk
        for (passes, chunk), w, rows in itertools.product(
                variants, [int(x) for x in args.silu_warps.split(",")], row_counts):
            row("silu_mul_quant", t, inter, w,
                lambda g, u, s, w=w, two=passes == 2, c=chunk, r=rows: silu_mul_quant(
                    g, u, s, num_warps=w, two_pass=two, chunk=c, rows=r, interpret=smoke),
                (gate, up, scales), moved, check=ref, passes=passes, chunk=chunk, rows=rows)
        x = jax.random.normal(key, (t, hidden), jnp.bfloat16)
        weight = jnp.ones((hidden,), jnp.bfloat16)
        moved = t * hidden * 2 + t * hidden + 4 * t
        ref = jax.jit(rms_norm_quant_reference, static_argnums=2)(x, weight, 1e-5)
        row("rms_norm_quant_xla", t, hidden, None,
            lambda a, b: rms_norm_quant_reference(a, b, 1e-5), (x, weight), moved)
        for w, rows in itertools.product([int(x) for x in args.rms_warps.split(",")],
                                         row_counts):
            row("rms_norm_quant", t, hidden, w,
                lambda a, b, w=w, r=rows: rms_norm_quant(a, b, 1e-5, num_warps=w, rows=r,
                                                         interpret=smoke),
                (x, weight), moved, check=ref, rows=rows)
        ref = jax.jit(quantize_rows_reference)(x)
        row("quantize_rows_xla", t, hidden, None, quantize_rows_reference, (x,), moved)
        for w, rows in itertools.product([int(x) for x in args.quant_warps.split(",")],
                                         row_counts):
            row("quantize_rows", t, hidden, w,
                lambda a, w=w, r=rows: quantize_rows(a, num_warps=w, rows=r, interpret=smoke),
                (x,), moved, check=ref, rows=rows)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
