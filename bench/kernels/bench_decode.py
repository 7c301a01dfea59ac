"""GPU benchmark of the paged decode-attention kernel (writes one JSON file).

    python bench/kernels/bench_decode.py --out bench/results/decode_attention_h200.json

Measures, in one run: device copy bandwidth; the Triton and the Mosaic GPU kernels'
achieved bandwidth for batches 64..1024, contexts 512..4096 and persistent-grid program
counts from 16 to a full grid; and jax's own Pallas `decode_attention.gqa` on the same
shapes ([B, S, KVH, D] layout).
Bytes counted: K and V of every sequence's context, read once.

    python bench/kernels/bench_decode.py --prefill-only --out PATH

    python bench/kernels/bench_decode.py --variants --out PATH

compares launch variants (keys per step, warps, pipelining stages, hand prefetch) at the
target shape (batch 512, context 1024) for bounded and full grids, then the Mosaic GPU
kernel (decode_attention_mgpu.py) at the same grids.

    python bench/kernels/bench_decode.py --prefill-only --out PATH

times, instead, chunked prefill two ways on the same batch (every token a row of the
decode kernel, as the engine does by default, against the chunked-prefill kernel) and the
KV append two ways (RoPE + scatter in XLA against the fused Pallas kernel).
"""
from __future__ import annotations

import argparse
import json
import time

import jax

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu
from pallas_kernels.device import device_sms

H, KVH, D = 32, 8, 128


def timed(fn, *args, iters=10, reps=5) -> float:
    """Median seconds per call, `iters` calls chained inside one jitted loop."""
    def loop(*a):
        def body(i, acc):
            out = fn(a[0] + (acc * 0).astype(a[0].dtype), *a[1:])
            return acc + out[0, 0, 0].astype(jnp.float32)
        return lax.fori_loop(0, iters, body, jnp.float32(0))
    f = jax.jit(loop)
    f(*args).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(*args).block_until_ready()
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def copy_bandwidth(gib=4) -> float:
    x = jnp.ones((gib << 28,), jnp.float32)
    def loop(x):
        return lax.fori_loop(0, 10, lambda i, y: y * 1.0001 + 1.0, x)
    f = jax.jit(loop)
    f(x).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append((time.perf_counter() - t) / 10)
    return 2 * x.nbytes / float(np.median(ts))


def pool_and_table(b, pages_per_seq, ps, rng):
    """(pool pages, page table [b, pages_per_seq]): every sequence its own pages, in random
    order; past what the kernels can address in one pool (B 1024 x ctx 4096 is 2^32
    elements) sequences draw pages at random from the largest pool they can address:
    at 4 GB it is far beyond the L2, so every read still comes from HBM."""
    from pallas_kernels.decode_attention import MAX_POOL_ELEMENTS
    need, cap = b * pages_per_seq, MAX_POOL_ELEMENTS // (KVH * ps * D)
    if need <= cap:
        return need, rng.permutation(need).reshape(b, pages_per_seq).astype(np.int32)
    return cap, rng.integers(0, cap, (b, pages_per_seq)).astype(np.int32)


def make_case(b, ctx, ps, rng):
    n, table = pool_and_table(b, ctx // ps, ps, rng)
    k = jax.random.normal(jax.random.PRNGKey(1), (n, KVH, ps, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (n, KVH, ps, D), jnp.bfloat16)
    pt = jnp.asarray(table)
    q = jax.random.normal(jax.random.PRNGKey(3), (b, H, D), jnp.bfloat16)
    lens = jnp.full((b,), ctx, jnp.int32)
    return q, k, v, pt, lens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/decode_attention_h200.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune-only", action="store_true")
    ap.add_argument("--skip-tuning", action="store_true")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--kernels", default="triton,mosaic",
                    help="with --variants: which kernels' variants to time")
    args = ap.parse_args()
    if args.prefill_only:
        return _prefill_and_append(args)
    if args.variants:
        return _variants(args)
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    sms = device_sms(dev)
    res = {"command": "python bench/kernels/bench_decode.py --out " + args.out,
           "device": dev.device_kind, "jax": jax.__version__, "num_sms": sms,
           "heads": H, "kv_heads": KVH, "head_dim": D, "dtype": "bfloat16"}
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    # correctness on the GPU against the f32 reference
    checks = []
    for b, ctx, ps in ((7, 300, 16), (64, 1024, 16), (33, 777, 64)):
        q, k, v, pt, _ = make_case(b, ((ctx + ps - 1) // ps) * ps, ps, rng)
        lens = jnp.asarray(rng.integers(1, ctx + 1, size=b).astype(np.int32))
        o = decode_attention(q, k, v, pt, lens, num_programs=66,
                             pages_per_block=max(1, 128 // ps))
        r = decode_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                       v.astype(jnp.float32), pt, lens)
        rel = float(jnp.linalg.norm(o.astype(jnp.float32) - r) / jnp.linalg.norm(r))
        checks.append({"batch": b, "max_context": ctx, "page_size": ps, "rel_error": rel,
                       "finite": bool(jnp.isfinite(o).all())})
        print("check", checks[-1], flush=True)
        try:  # the Mosaic GPU kernel on the same case (Hopper only)
            o = decode_attention_mgpu(q, k, v, pt, lens, num_programs=66)
            checks.append({"kernel": "mosaic_gpu", "batch": b, "max_context": ctx,
                           "page_size": ps, "finite": bool(jnp.isfinite(o).all()),
                           "rel_error": float(jnp.linalg.norm(o.astype(jnp.float32) - r)
                                              / jnp.linalg.norm(r))})
        except Exception as e:
            checks.append({"kernel": "mosaic_gpu", "batch": b, "page_size": ps,
                           "error": f"{type(e).__name__}: {e}"[:300]})
        print("check", checks[-1], flush=True)
    res["correctness"] = checks
    save()

    # tuning at the target shape: block of keys per step, warps, pipelining, page size
    if args.skip_tuning:  # the kernel's defaults, chosen by an earlier tuning run
        _sweep(args, res, rng, bw, sms, save, None, 4, 2)
        return
    tune = []
    nbytes = 2 * 512 * 1024 * KVH * D * 2
    for ps in (16, 64, 128):
        q, k, v, pt, lens = make_case(512, 1024, ps, rng)
        for block_k, warps, stages in ((64, 4, 2), (128, 4, 2), (128, 4, 3), (256, 4, 2),
                                       (128, 8, 2), (256, 8, 3)):
            ppb = max(1, block_k // ps)
            for nprog in (sms // 2, sms, sms * 2, sms * 4, None):
                t = timed(lambda *a: decode_attention(
                    *a, num_programs=nprog, pages_per_block=ppb, num_warps=warps,
                    num_stages=stages), q, k, v, pt, lens)
                tune.append({"page_size": ps, "pages_per_block": ppb, "block_k": ppb * ps,
                             "num_warps": warps, "num_stages": stages,
                             "programs": nprog or 512 * KVH, "seconds": t,
                             "GBps": nbytes / t / 1e9, "fraction_of_copy": nbytes / t / bw})
                print("tune", tune[-1], flush=True)
        res["tuning_b512_ctx1024"] = tune
        save()
    best = max((r for r in tune if r["page_size"] == 16), key=lambda r: r["GBps"])
    ppb, warps, stages = best["pages_per_block"], best["num_warps"], best["num_stages"]
    res["sweep_config"] = {"page_size": 16, "pages_per_block": ppb, "num_warps": warps,
                           "num_stages": stages}
    save()
    if args.tune_only:
        print("done", flush=True)
        return
    _sweep(args, res, rng, bw, sms, save, ppb, warps, stages)


def _sweep(args, res, rng, bw, sms, save, ppb, warps, stages):
    res["sweep_config"] = {"page_size": 16, "pages_per_block": ppb or "default (64 keys)",
                           "num_warps": warps, "num_stages": stages}
    batches = (64, 512) if args.quick else (64, 256, 512, 1024)
    contexts = (1024,) if args.quick else (512, 1024, 2048, 4096)
    cases = []
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_da
    for b in batches:
        for ctx in contexts:
            q, k, v, pt, lens = make_case(b, ctx, 16, rng)
            nbytes = 2 * b * ctx * KVH * D * 2
            full = b * KVH
            for nprog in sorted({16, sms // 2, sms, 2 * sms, 4 * sms, full}):
                if nprog > full:
                    continue
                t = timed(lambda *a: decode_attention(*a, num_programs=nprog,
                                                      pages_per_block=ppb, num_warps=warps,
                                                      num_stages=stages), q, k, v, pt, lens)
                cases.append({"kernel": "nanojax_paged", "batch": b, "context": ctx,
                              "programs": nprog, "seconds": t, "GBps": nbytes / t / 1e9,
                              "fraction_of_copy": nbytes / t / bw})
                print(cases[-1], flush=True)
            # the Mosaic GPU kernel: one program per SM, so its full grid is the SM count
            for nprog in sorted({16, sms // 4, sms // 2, sms}):
                cases.append(measure(
                    {"kernel": "nanojax_paged_mosaic_gpu", "batch": b, "context": ctx,
                     "programs": nprog},
                    lambda *a, n=nprog: decode_attention_mgpu(*a, num_programs=n),
                    (q, k, v, pt, lens), nbytes, bw))
                print(cases[-1], flush=True)
            # jax's gqa on contiguous [B, S, KVH, D] caches of the same contents
            kc = k[pt].transpose(0, 1, 3, 2, 4).reshape(b, ctx, KVH, D)
            vc = v[pt].transpose(0, 1, 3, 2, 4).reshape(b, ctx, KVH, D)
            try:
                t = timed(lambda qq, kk, vv: jax_da.gqa(qq, kk, vv), q, kc, vc)
                cases.append({"kernel": "jax_gqa_BSKD", "batch": b, "context": ctx,
                              "seconds": t, "GBps": nbytes / t / 1e9,
                              "fraction_of_copy": nbytes / t / bw})
            except Exception as e:  # keep the sweep going
                cases.append({"kernel": "jax_gqa_BSKD", "batch": b, "context": ctx,
                              "error": f"{type(e).__name__}: {e}"[:300]})
            print(cases[-1], flush=True)
            del kc, vc
            res["cases"] = cases
            save()
    print("done", flush=True)


def measure(row: dict, fn, inputs, nbytes: int, bw: float, check=None, timer=timed) -> dict:
    """One benchmark row: run fn(*inputs) once (check(out) -> fields to record), time it,
    add GB/s and the fraction of copy bandwidth. A variant that fails to compile or run is
    a result too: its error is recorded and the sweep goes on."""
    try:
        out = fn(*inputs)
        if check is not None:
            row.update(check(out))
        t = timer(fn, *inputs)
        row.update(seconds=t, GBps=nbytes / t / 1e9, fraction_of_copy=nbytes / t / bw)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:600]
    return row


# (keys per step, warps, pipelining stages, hand prefetch of the next block)
VARIANTS = ((64, 4, 2, False), (128, 4, 2, False), (256, 4, 2, False),
            (32, 4, 2, True), (64, 4, 2, True), (64, 8, 2, True), (128, 4, 2, True),
            (128, 8, 2, True), (256, 8, 2, True), (64, 4, 1, True), (128, 8, 1, True))


# the Mosaic GPU kernel (decode_attention_mgpu.py): (workers per program, keys per step,
# steps in flight per worker, hardware exp2); SMEM holds 227 KB
MOSAIC_VARIANTS = ((1, 64, 2, True), (1, 64, 4, True), (2, 64, 2, True), (2, 64, 2, False),
                   (2, 128, 1, True))


def _variants(args):
    """Launch variants at the target shape, every grid size, one process."""
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    sms = device_sms(dev)
    bw = copy_bandwidth()
    kernels = args.kernels.split(",")
    res = {"command": f"python bench/kernels/bench_decode.py --variants --kernels "
                      f"{args.kernels} --out {args.out}",
           "device": dev.device_kind, "jax": jax.__version__, "num_sms": sms,
           "copy_bandwidth_GBps": bw / 1e9, "batch": 512, "context": 1024, "page_size": 16,
           "variants": []}
    b, ctx, ps = 512, 1024, 16
    q, k, v, pt, lens = make_case(b, ctx, ps, rng)
    ref = decode_attention(q, k, v, pt, lens)
    nbytes = 2 * b * ctx * KVH * D * 2
    for block_k, warps, stages, prefetch in VARIANTS * ("triton" in kernels):
        for nprog in (sms // 2, sms, 2 * sms, 4 * sms, b * KVH):
            def fn(*a, nprog=nprog, block_k=block_k, warps=warps, stages=stages,
                   prefetch=prefetch):
                return decode_attention(*a, num_programs=nprog, pages_per_block=block_k // ps,
                                        num_warps=warps, num_stages=stages, prefetch=prefetch)
            row = measure({"block_k": block_k, "num_warps": warps, "num_stages": stages,
                           "prefetch": prefetch, "programs": nprog},
                          fn, (q, k, v, pt, lens), nbytes, bw,
                          check=lambda out: {"max_abs_diff_vs_default": float(jnp.max(jnp.abs(
                              out.astype(jnp.float32) - ref.astype(jnp.float32))))})
            res["variants"].append(row)
            print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    ref32 = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), pt, lens)
    for wgs, block_k, stages, approx in MOSAIC_VARIANTS * ("mosaic" in kernels):
        for nprog in (sms // 4, sms // 2, sms, 2 * sms):
            def fn(*a, nprog=nprog, block_k=block_k, stages=stages, wgs=wgs, approx=approx):
                return decode_attention_mgpu(*a, num_programs=nprog, block_k=block_k,
                                             stages=stages, warpgroups=wgs,
                                             approx_math=approx)
            row = measure({"kernel": "mosaic_gpu", "warpgroups": wgs, "block_k": block_k,
                           "stages": stages, "approx_math": approx, "programs": nprog}, fn, (q, k, v, pt, lens), nbytes, bw,
                          check=lambda out: {"rel_error_vs_f32_reference": float(
                              jnp.linalg.norm(out.astype(jnp.float32) - ref32)
                              / jnp.linalg.norm(ref32))})
            res["variants"].append(row)
            print(row, flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    print("done", flush=True)


def _prefill_and_append(args):
    from nanojax.profiling.timing import device_seconds
    from nanojax.layers.rotary import inverse_frequencies
    from pallas_kernels.prefill_attention import prefill_attention_impl, query_blocks
    from pallas_kernels.rope_append import rope_append_impl
    rng = np.random.default_rng(0)
    res = {"command": "python bench/kernels/bench_decode.py --prefill-only --out "
                      + args.out, "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "prefill": [], "append": []}
    ps = 16
    for prefix, chunk, n_chunks in ((0, 512, 4), (1024, 512, 4), (0, 2048, 1)):
        ctx = prefix + chunk
        pages = -(-ctx // ps)
        n = n_chunks * pages + 1
        k = jax.random.normal(jax.random.PRNGKey(1), (n, KVH, ps, D), jnp.bfloat16)
        v = jax.random.normal(jax.random.PRNGKey(2), (n, KVH, ps, D), jnp.bfloat16)
        pt = jnp.asarray(rng.permutation(n)[:n_chunks * pages].reshape(n_chunks, pages)
                         .astype(np.int32))
        seq = np.repeat(np.arange(n_chunks), chunk).astype(np.int32)
        pos = np.tile(np.arange(prefix, ctx), n_chunks).astype(np.int32)
        q = jax.random.normal(jax.random.PRNGKey(3), (len(seq), H, D), jnp.bfloat16)
        rows = device_seconds(lambda q, k, v: decode_attention(
            q, k, v, pt[seq], jnp.asarray(pos + 1)), q, k, v)
        case = {"prefix": prefix, "chunk": chunk, "chunks": n_chunks,
                "decode_rows_seconds": rows}
        for bq in (16, 32):
            blocks, slot = query_blocks(seq, pos, bq)
            t = device_seconds(lambda q, k, v, bq=bq, blocks=blocks, slot=slot:
                               prefill_attention_impl(q, k, v, pt, jnp.asarray(pos),
                                                      jnp.asarray(blocks), jnp.asarray(slot),
                                                      block_q=bq), q, k, v)
            case[f"prefill_kernel_bq{bq}_seconds"] = t
            case[f"speedup_bq{bq}"] = rows / t
        res["prefill"].append(case)
        print(case, flush=True)
    inv = inverse_frequencies(D, 500000.0)
    from nanojax.layers.attention import write_kv_pages
    from nanojax.layers.rotary import apply_rope
    for t in (1024, 2048, 4096):
        n = 16384
        kp = jnp.zeros((n, KVH, ps, D), jnp.bfloat16)
        vp = jnp.zeros((n, KVH, ps, D), jnp.bfloat16)
        kk = jax.random.normal(jax.random.PRNGKey(4), (t, KVH, D), jnp.bfloat16)
        pos = jnp.asarray(rng.integers(0, 4096, t).astype(np.int32))
        slots = jnp.asarray(rng.permutation(n * ps)[:t].astype(np.int32))
        xla = device_seconds(lambda k, v, a, b: write_kv_pages(
            a, b, apply_rope(k, pos, inv), v, slots), kk, kk, kp, vp)
        fused = device_seconds(lambda k, v, a, b: rope_append_impl(
            k, v, a, b, pos, slots, inv), kk, kk, kp, vp)
        res["append"].append({"tokens": t, "xla_seconds": xla, "fused_seconds": fused,
                              "speedup": xla / fused})
        print(res["append"][-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
