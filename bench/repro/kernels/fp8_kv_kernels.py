"""GPU: the KV kernels with bf16 pages against FP8 pages, in one process.

    python bench/repro/kernels/fp8_kv_kernels.py OUT.json            # H200: ~3-5 minutes
    python bench/repro/kernels/fp8_kv_kernels.py OUT.json --smoke    # CPU, interpret mode: runs
    python bench/repro/kernels/fp8_kv_kernels.py OUT.json --decode-kernels triton,swapab \
        --decode-only                                          # both decode kernels

Rows: the decode kernel (pallas_kernels/decode_attention.py) at batch x context 512 x 1024,
16 x 4096 and 1024 x 4096 (32/8 heads, D 128, page 16) on its full grid and on bounded
grids; the chunked-prefill kernel on 4 chunks of 512 tokens after 512-token prefixes (its
queries gathered into blocks, and `prefill_in_place`: read and written where they lie); the
fused RoPE + append kernel on 2048 tokens. Each row: seconds, GB/s of the bytes actually
read (FP8 pages are half), fraction of the device's copy bandwidth measured in the same
run, and for FP8 the time relative to bf16 (what the iteration gains). FP8 decode rows
come twice: widened to f16 (`fp8`, the kernel's default) and to bf16 (`fp8_bf16math`).
Decode rows at 512 x 1024 also check the output against the reference. With
`--decode-kernels ...,swapab` the Mosaic GPU swap-AB kernel (one program per SM: the full
grid, 66 and 44) gets the same bf16 and fp8 rows (`decode_swapab`). `--swapab-variants
w2s3,w4s2k128` adds rows of those launch variants (W workers x S stages [x 128-key
blocks]) on the full grid, bf16 and fp8, named `decode_swapab_w2s3`...: FP8 halves the
bytes of a block, so the defaults tuned for bf16 keep half the bytes in flight. A `q8`
suffix (`q8` alone: the default launch) runs the FP8 rows with the query in e4m3 too
(`fp8_query`: QK^T as an FP8 WGMMA, no widening of the keys); such variants have no bf16 row.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path

import jax

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
from bench_decode import copy_bandwidth, pool_and_table  # noqa: E402  (shared with the sweep)
from pallas_kernels.device import device_sms  # noqa: E402

H, KVH, D, PS = 32, 8, 128, 16
FP8_MAX = 448.0


def pages(n, key, fp8: bool):
    """Random bf16 pages, or the same values as FP8 with per-head scales (absmax / 448)."""
    x = jax.random.normal(jax.random.PRNGKey(key), (n, KVH, PS, D), jnp.bfloat16)
    if not fp8:
        return x, None
    scale = jnp.full((KVH,), 4.5 / FP8_MAX, jnp.float32)  # N(0,1) stays inside +-4.5 here
    q = jnp.clip(x.astype(jnp.float32) / scale[None, :, None, None], -FP8_MAX, FP8_MAX)
    return q.astype(jnp.float8_e4m3fn), scale


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes in interpret mode (checks that the script runs)")
    ap.add_argument("--decode-kernels", default="triton",
                    help="comma-separated: triton, swapab (the Mosaic GPU kernel, Hopper)")
    ap.add_argument("--decode-only", action="store_true",
                    help="no chunked-prefill and append rows")
    ap.add_argument("--shapes", default="512x1024,16x4096,1024x4096",
                    help="decode rows' batch x context, comma-separated ('': no decode rows)")
    ap.add_argument("--swapab-variants", default="",
                    help="comma-separated [wWsS][k128][q8]: swap-AB launch variants on the "
                         "full grid (workers, stages, 128-key blocks, FP8 query)")
    args = ap.parse_args()
    from pallas_kernels.decode_attention import decode_attention_impl, decode_attention_reference
    from pallas_kernels.decode_attention_swapab import decode_attention_swapab
    from pallas_kernels.prefill_attention import prefill_attention_impl, query_blocks
    from pallas_kernels.rope_append import rope_append_impl
    from nanojax.profiling.timing import device_seconds, device_seconds_stateful

    smoke = args.smoke
    interp = dict(interpret=True) if smoke else {}
    shapes = [(4, 64)] if smoke else [tuple(int(x) for x in s.split("x"))
                                      for s in filter(None, args.shapes.split(","))]
    kernels = args.decode_kernels.split(",")
    if set(kernels) - {"triton", "swapab"}:
        ap.error(f"unknown decode kernels in {args.decode_kernels!r}")
    grids = {"triton": [None, 3] if smoke else [None, 528, 264, 132],
             "swapab": [None, 1] if smoke else [None, 66, 44]}
    variants = {"": {}}  # row name suffix -> swap-AB launch arguments (full grid)
    for v in filter(None, args.swapab_variants.split(",")):
        m = re.fullmatch(r"(?:w(\d+)s(\d+))?(k128)?(q8)?", v)
        if m is None:
            ap.error(f"swap-AB variant {v!r}: expected [wWsS][k128][q8]")
        variants["_" + v] = {**(dict(warpgroups=int(m[1]), stages=int(m[2])) if m[1] else {}),
                             "block_k": 128 if m[3] else 64,
                             **(dict(fp8_query=True) if m[4] else {})}
    bw = copy_bandwidth(1 if smoke else 4)
    res = {"command": "python " + " ".join(sys.argv), "copy_bandwidth_GBps": bw / 1e9,
           "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                   "device": jax.devices()[0].device_kind, "python": platform.python_version(),
                   "xla_flags": os.environ.get("XLA_FLAGS", "")},
           "rows": []}
    rng = np.random.default_rng(0)

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))

    reps = dict(iters=1, reps=1) if smoke else dict(iters=20, reps=5)

    def row(kind, dtype, fn, inputs, nbytes, state=None, **info):
        r = {"kernel": kind, "kv_dtype": dtype, **info}
        try:
            if state is None:
                jax.block_until_ready(fn(*inputs))
                t = device_seconds(fn, *inputs, **reps)
            else:  # the pages are the state, updated in place (as the step's cache)
                t = device_seconds_stateful(fn, state, *inputs, **reps)
            r.update(seconds=t, GBps=nbytes / t / 1e9, fraction_of_copy=nbytes / t / bw)
        except Exception as e:  # a failure is a result too
            r["error"] = f"{type(e).__name__}: {e}"[:800]
        res["rows"].append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
        save()
        return r

    for b, ctx in shapes:
        n, table = pool_and_table(b, ctx // PS, PS, rng)
        pt = jnp.asarray(table)
        lens = jnp.full((b,), ctx, jnp.int32)
        q = jax.random.normal(jax.random.PRNGKey(3), (b, H, D), jnp.bfloat16)
        # FP8 widened to f16 (the kernel's default) and to bf16 (before 2026-12-01)
        for kernel, name, fp8, compute in [
                (kn, *v) for kn in kernels for v in (
                    ("bf16", False, "float16"), ("fp8", True, "float16"),
                    ("fp8_bf16math", True, "bfloat16"))
                if kn == "triton" or v[0] != "fp8_bf16math"]:  # swap-AB: f16 WGMMAs
            (k, ks), (v, vs) = pages(n, 1, fp8), pages(n, 2, fp8)
            nbytes = 2 * b * ctx * KVH * D * k.dtype.itemsize
            check = None
            if b == shapes[0][0]:  # the output against the reference on the same pages
                ref = decode_attention_reference(q.astype(jnp.float32), k, v, pt, lens, ks, vs)
                check = np.asarray(ref, np.float64)
            launches = [(g, "", {}) for g in grids[kernel]]
            if kernel == "swapab":
                launches += [(None, sfx, kw) for sfx, kw in variants.items()
                             if sfx and (fp8 or not kw.get("fp8_query"))]
            for g, sfx, kw in launches:
                def fn(q, k, v, pt, lens, ks, vs, g=g, compute=compute, kernel=kernel, kw=kw):
                    if kernel == "swapab":
                        return decode_attention_swapab(q, k, v, pt, lens, k_scale=ks,
                                                       v_scale=vs, num_programs=g, **kw,
                                                       **interp)
                    return decode_attention_impl(q, k, v, pt, lens, k_scale=ks, v_scale=vs,
                                                 num_programs=g, fp8_compute=compute,
                                                 **interp)
                full = (b * KVH if kernel == "triton"
                        else device_sms())
                r = row("decode" if kernel == "triton" else "decode_swapab" + sfx, name, fn,
                        (q, k, v, pt, lens, ks, vs), nbytes, batch=b, context=ctx,
                        programs=g or full)
                if check is not None and "error" not in r:
                    out = np.asarray(fn(q, k, v, pt, lens, ks, vs), np.float64)
                    r["rel_err_vs_reference"] = float(np.linalg.norm(out - check)
                                                      / np.linalg.norm(check))
                    save()
            del k, v

    if args.decode_only:
        return finish(res, save, args.out)
    # chunked prefill: 4 chunks of C tokens, each after a prefix of C cached tokens
    c = 16 if smoke else 512
    chunks = 4
    n = chunks * 2 * c // PS
    pt = jnp.asarray(np.arange(n, dtype=np.int32).reshape(chunks, 2 * c // PS))
    seq_ids = np.repeat(np.arange(chunks, dtype=np.int32), c)
    positions = np.tile(np.arange(c, 2 * c, dtype=np.int32), chunks)
    blocks, slot = query_blocks(seq_ids, positions, 16)
    qp = jax.random.normal(jax.random.PRNGKey(4), (chunks * c, H, D), jnp.bfloat16)
    for fp8 in (False, True):
        (k, ks), (v, vs) = pages(n, 5, fp8), pages(n, 6, fp8)
        nbytes = 2 * n * PS * KVH * D * k.dtype.itemsize  # every page at least once

        def fn(q, k, v, ks, vs):
            return prefill_attention_impl(q, k, v, pt, jnp.asarray(positions),
                                          jnp.asarray(blocks), jnp.asarray(slot),
                                          k_scale=ks, v_scale=vs, **interp)
        row("prefill", "fp8" if fp8 else "bf16", fn, (qp, k, v, ks, vs), nbytes,
            tokens=chunks * c, chunk=c)

        def in_place(out, q, k, v, ks, vs):  # written into an output buffer (the engine's)
            out = prefill_attention_impl(q, k, v, pt, jnp.asarray(positions),
                                         jnp.asarray(blocks), jnp.asarray(slot),
                                         k_scale=ks, v_scale=vs, out=out, **interp)
            return out, out[0, 0, 0]
        row("prefill_in_place", "fp8" if fp8 else "bf16", in_place, (qp, k, v, ks, vs),
            nbytes, state=jnp.zeros_like(qp), tokens=chunks * c, chunk=c)

    # fused RoPE + append of 2048 tokens into a pool of 16384 pages
    t = 64 if smoke else 2048
    n = 256 if smoke else 16384
    kn = jax.random.normal(jax.random.PRNGKey(7), (t, KVH, D), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(n * PS)[:t].astype(np.int32))
    pos = jnp.asarray(rng.integers(0, 4096, t).astype(np.int32))
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, D, 2) / D))
    for fp8 in (False, True):
        (kp, ks), (vp, vs) = pages(n, 8, fp8), pages(n, 9, fp8)
        nbytes = 2 * t * KVH * D * (2 + kp.dtype.itemsize)  # read bf16, write the page dtype

        def fn(state, k, v, ks, vs):
            out = rope_append_impl(k, v, *state, pos, slots, inv_freq, k_scale=ks,
                                   v_scale=vs, **interp)
            return out, out[0][0, 0, 0]
        row("rope_append", "fp8" if fp8 else "bf16", fn, (kn, kn, ks, vs), nbytes,
            state=(kp, vp), tokens=t)
        del kp, vp

    return finish(res, save, args.out)


def finish(res, save, out) -> int:
    """FP8 time relative to bf16, row by row; the JSON written."""
    key = lambda r: (r["kernel"], r.get("batch"), r.get("context"), r.get("programs"))  # noqa
    bf16 = {key(r): r for r in res["rows"] if r["kv_dtype"] == "bf16" and "seconds" in r}
    for r in res["rows"]:
        if r["kv_dtype"].startswith("fp8") and "seconds" in r and key(r) in bf16:
            r["time_over_bf16"] = r["seconds"] / bf16[key(r)]["seconds"]
    save()
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
