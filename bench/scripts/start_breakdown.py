"""Where a warm start's step compile goes (issue 20 item 3), without the device: trace and
lower the runner's jitted step for every token bucket, timing each phase. With
--platform cuda the step is the GPU serve's (UnrolledForward with the Pallas kernels of
--decode-kernel, bf16, fixed shapes, abstract params and KV: no weights are made) lowered
for CUDA on this machine; nothing is compiled. With --platform cpu it is the CPU's
default forward on real (random) weights, traced, lowered and compiled (a compile with a
warm persistent cache is the cache load).

    python bench/scripts/start_breakdown.py OUT.json --platform cuda --model llama3-8b \
        --b-dense 2048 --decode-kernel mosaic

On a GPU with a warm persistent cache the step's cost is trace + lower + cache lookup and
load; the first two are what this measures (CPU-timed: the GPU box's host is another CPU).
"""
import argparse
import json
import platform
import sys
import time
import types

import jax
import numpy as np


def build_runner(args):
    from nanojax.config import KernelConfig, named_shape
    from nanojax.engine.forward import UnrolledForward, default_forward
    from nanojax.engine.kv_cache import size_cache
    from nanojax.engine.runner import ModelRunner
    from nanojax.layers.attention import pallas_backend
    from nanojax.models import init_params

    cfg = named_shape(args.model, args.dtype)
    if args.num_layers:
        cfg = cfg.replace(num_layers=args.num_layers)
    if args.platform == "cuda":
        # auto picks mosaic on Hopper; here (no GPU) it must be named
        forward = UnrolledForward(cfg, attention=pallas_backend(
            KernelConfig(decode_kernel=args.decode_kernel)))
        params = jax.eval_shape(lambda: init_params(cfg))
        forward.prepare = lambda p: p  # abstract: nothing is placed
        init_kv = forward.init_kv
        forward.init_kv = lambda n, ps, dt=None: jax.eval_shape(lambda: init_kv(n, ps, dt))
        sizing = size_cache(cfg, 16, 2048, args.b_dense, memory_bytes=args.kv_bytes)
        min_rows, min_tokens = 4, 16
    else:
        forward = default_forward(cfg)
        params = init_params(cfg)
        sizing = size_cache(cfg, 16, 2048, args.b_dense, num_pages=max(64, 8 * 2048 // 16))
        min_rows, min_tokens = 1, 16
    runner = ModelRunner(cfg, params, sizing.num_pages, 16, sizing.max_num_seqs,
                         args.b_dense, forward=forward, max_pages_per_seq=2048 // 16,
                         fixed_shapes=True, min_token_bucket=min_tokens,
                         min_row_bucket=min_rows)
    return cfg, runner, sizing


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--platform", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--b-dense", type=int, default=2048)
    ap.add_argument("--decode-kernel", default="mosaic")
    # the H200's KV budget: 0.9 x 143.8 GB less the 8B's 16.1 GB of weights
    ap.add_argument("--kv-bytes", type=int, default=int(0.9 * 143.8e9 - 16.1e9))
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.platform == "cuda" else None)

    t0 = time.perf_counter()
    cfg, runner, sizing = build_runner(args)
    setup_s = time.perf_counter() - t0
    shapes = []
    for t in runner.token_buckets():
        empty = types.SimpleNamespace(entries=[], num_decodes=0, num_tokens=t)
        host_tokens, token_src, meta, logit_idx, *_ = runner._host_inputs(
            empty, *runner.shapes_for(empty))
        step_args = (runner.params, runner.kv, runner._prev, host_tokens, token_src, meta,
                     logit_idx)
        row = {"tokens": t, "shape": list(runner.shapes_for(empty))}
        if runner.forward.traced:
            t1 = time.perf_counter()
            traced = runner._forward.trace(*step_args)
            t2 = time.perf_counter()
            if args.platform == "cuda":
                lowered = traced.lower(lowering_platforms=("cuda",))
            else:
                lowered = traced.lower()
            t3 = time.perf_counter()
            row.update(trace_s=round(t2 - t1, 3), lower_s=round(t3 - t2, 3),
                       stablehlo_chars=len(lowered.as_text()))
            if args.platform == "cpu":
                lowered.compile()
                row["compile_or_load_s"] = round(time.perf_counter() - t3, 3)
        else:
            # CPU: the layerwise forward dispatches per-layer jits; the whole step's first
            # call is trace + lower + compile (or cache load) of each piece
            t1 = time.perf_counter()
            jax.block_until_ready(runner.launch(empty).tokens)
            row["first_call_s"] = round(time.perf_counter() - t1, 3)
            t2 = time.perf_counter()
            jax.block_until_ready(runner.launch(empty).tokens)
            row["second_call_s"] = round(time.perf_counter() - t2, 3)
        shapes.append(row)
        print(row, file=sys.stderr, flush=True)
    total = {k: round(sum(r.get(k, 0) for r in shapes), 3)
             for k in ("trace_s", "lower_s", "compile_or_load_s", "first_call_s")}
    out = {
        "command": "python " + " ".join(sys.argv),
        "measure": ("trace and lower of the runner's jitted step per token bucket, timed on "
                    "this CPU host; nothing runs on a GPU" if args.platform == "cuda" else
                    "the CPU step per token bucket on this host"),
        "platform": args.platform, "model": args.model, "num_layers": cfg.num_layers,
        "dtype": str(cfg.dtype), "b_dense": args.b_dense,
        "decode_kernel": args.decode_kernel if args.platform == "cuda" else None,
        "num_pages": sizing.num_pages, "max_rows": runner.max_rows,
        "setup_s": round(setup_s, 3), "shapes": shapes, "total": total,
        "jax": jax.__version__, "host": platform.node(), "cpus": __import__("os").cpu_count(),
        "compile_cache": jax.config.jax_compilation_cache_dir,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(total), file=sys.stderr)


if __name__ == "__main__":
    main()
