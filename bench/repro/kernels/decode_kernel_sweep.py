"""Decode attention on few SMs, one call: the swap-AB Mosaic GPU kernel against the current
Mosaic GPU kernel, the Triton kernel and PyTorch's SDPA on green-context SM subsets.

    PYTHONPATH=. python3 bench/repro/kernels/decode_kernel_sweep.py OUT.json [--quick]

`--dry-run` runs the same flow on the CPU (tiny shapes, Pallas interpret mode, no
PyTorch part) to check the script itself before spending GPU time (~6 min on 2 cores).

Expected run time on one H200: 6-7 minutes. Rows start in order of importance (full grid,
66 and 44 programs at the target shape; the other shapes; the other grids); none starts
after 400 s (a skipped row says so in the JSON), and a watchdog writes the JSON and exits
if nothing finishes for 120 s (a hung kernel). Writes OUT.json after every row and prints
a table last. Kernels: `swapab` (pallas_kernels/decode_attention_swapab.py, defaults) and
its launch variants (`_wWsS`: W workers x S stages; `_k128`: 128-key blocks; `_n16`: the
group padded to 16 columns; `_splitsN`), `mosaic_rows` (decode_attention_mgpu.py),
`triton` (decode_attention.py), `swapab_fp8`. What it measures, in this order:

1. PyTorch SDPA decode (q [B, 32, 1, 128], contiguous k/v [B, 8, ctx, 128], enable_gqa) on
   the full GPU and on green contexts of 32/44/48/64 SMs (CUDA driver API through
   cuda.bindings, as ../shared/probes/overlap_green_streams.py), in a subprocess that runs
   before JAX takes the GPU's memory. Green contexts round an SM count to what the
   hardware allows; the JSON records the count granted.
2. Copy bandwidth (read + write of 2 x 4 GiB), the reference every fraction divides by.
3. Correctness on the GPU against the f32 reference (random lengths, poisoned unused
   pages) for every kernel and variant before it is timed; a variant that fails is
   recorded and not timed.
4. Compile time of each kernel for the B 512 ctx 1024 shape (lower + compile, one call).
5. Achieved bandwidth (K and V bytes of every context, read once / time) as a fraction of
   copy for B 512 ctx 1024 (LLaMA-3-8B heads, D 128, bf16, pages of 16) at 22/33/44/66/
   99/132 programs, and B 16 ctx 4096, B 1024 ctx 4096 at the full grid. `swapab_fp8`:
   the same kernel on float8_e4m3fn pages with per-kv-head scales (its bytes are half;
   its fraction counts the bytes it reads).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pallas_kernels.device import device_sms

H, KVH, D, PS = 32, 8, 128, 16
GRIDS = (22, 33, 44, 66, 99, 132)
GREEN_SMS = (32, 44, 48, 64)
SHAPES = ((512, 1024), (16, 4096), (1024, 4096))
BUDGET_S = 400  # stop timing new rows after this (the call must end within 8 minutes)
HANG_S = 120  # no row, check or step finished for this long: a hung kernel


def torch_part(out_path: str, quick: bool):
    """SDPA decode on the full GPU and on green-context SM subsets (own process)."""
    import torch
    import torch.nn.functional as F
    res = {"torch": torch.__version__, "rows": []}

    def timeit(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
        ts.sort()
        return ts[len(ts) // 2]

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    subsets = []
    try:
        from cuda.bindings import driver as cu

        def ok(r):
            err, rest = (r[0], r[1:]) if isinstance(r, tuple) else (r, ())
            if int(err) != 0:
                raise RuntimeError(f"CUDA driver error {err}")
            return rest[0] if len(rest) == 1 else rest

        cudev = ok(cu.cuDeviceGet(0))
        sm = ok(cu.cuDeviceGetDevResource(cudev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        res["total_sms"] = int(sm.sm.smCount)
        for n in GREEN_SMS:
            try:
                groups, _, _ = ok(cu.cuDevSmResourceSplitByCount(1, sm, 0, n))[:3]
                desc = ok(cu.cuDevResourceGenerateDesc([groups[0]], 1))
                g = ok(cu.cuGreenCtxCreate(desc, cudev,
                                           cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
                s = ok(cu.cuGreenCtxStreamCreate(g, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
                subsets.append((n, int(groups[0].sm.smCount), torch.cuda.ExternalStream(int(s))))
            except Exception as e:  # record and go on with the others
                res["rows"].append({"sms_requested": n, "error": repr(e)[:300]})
    except Exception as e:
        res["green_context_error"] = repr(e)[:300]
    for b, ctx in SHAPES[:1] if quick else SHAPES:
        q = torch.randn(b, H, 1, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, KVH, ctx, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, KVH, ctx, D, device=dev, dtype=torch.bfloat16)
        nbytes = 2 * b * KVH * ctx * D * 2

        def attn():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        t = timeit(attn)
        res["rows"].append({"batch": b, "context": ctx, "sms": "all", "seconds": t,
                            "GBps": nbytes / t / 1e9})
        for n, granted, stream in subsets:
            def on_subset():
                cur = torch.cuda.current_stream()
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    attn()
                cur.wait_stream(stream)
            try:
                t = timeit(on_subset)
                res["rows"].append({"batch": b, "context": ctx, "sms_requested": n,
                                    "sms": granted, "seconds": t, "GBps": nbytes / t / 1e9})
            except Exception as e:
                res["rows"].append({"batch": b, "context": ctx, "sms_requested": n,
                                    "error": repr(e)[:300]})
        del q, k, v
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    dry = "--dry-run" in sys.argv  # CPU: tiny shapes, interpret mode
    t_start = time.perf_counter()
    res = {"command": "PYTHONPATH=. python3 bench/repro/kernels/decode_kernel_sweep.py "
                      + " ".join(sys.argv[1:])}

    def save():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
        progress[0] = time.perf_counter()

    # a watchdog: a kernel that hangs (a barrier never completes) would hold the GPU until
    # the call's limit; after HANG_S without progress, record where and exit
    import threading
    progress = [float("inf"), "start"]  # armed by the first save, after the PyTorch part

    def watchdog():
        while True:
            time.sleep(5)
            if time.perf_counter() - progress[0] > HANG_S and not dry:
                res["hung"] = f"no progress for {HANG_S} s during: {progress[1]}"
                with open(out_path, "w") as f:
                    json.dump(res, f, indent=1)
                print("HUNG:", res["hung"], flush=True)
                os._exit(3)
    threading.Thread(target=watchdog, daemon=True).start()

    # 1. PyTorch first, in its own process, before JAX preallocates the GPU's memory
    torch_out = out_path + ".torch.json"
    try:
        if dry:
            raise RuntimeError("dry run: no PyTorch part")
        subprocess.run([sys.executable, __file__, "--torch-part", torch_out]
                       + (["--quick"] if quick else []), check=True, timeout=200)
        with open(torch_out) as f:
            res["torch_sdpa"] = json.load(f)
        os.remove(torch_out)
    except Exception as e:
        res["torch_sdpa"] = {"error": repr(e)[:300]}
    save()

    import jax
    import jax.numpy as jnp
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "kernels"))
    from bench_decode import copy_bandwidth, make_case, measure, timed
    from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
    from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu
    from pallas_kernels.decode_attention_swapab import decode_attention_swapab, default_splits

    global GRIDS, SHAPES, PS, BUDGET_S
    dev = jax.devices()[0]
    sms = device_sms(dev)
    timer = timed
    if dry:
        import bench_decode as bd
        sms, GRIDS, SHAPES, PS = 2, (1,), ((2, 128), (1, 256)), 16
        BUDGET_S = 1e9
        bd.H, bd.KVH, bd.D = H, KVH, D

        def timer(fn, *a):
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            return time.perf_counter() - t
    res.update(device=dev.device_kind, jax=jax.__version__, num_sms=sms, heads=H,
               kv_heads=KVH, head_dim=D, page_size=PS, dtype="bfloat16")
    bw = 1e10 if dry else copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for row in res["torch_sdpa"].get("rows", []):
        if "GBps" in row:
            row["fraction_of_copy"] = row["GBps"] * 1e9 / bw
    save()

    # the kernels and variants: name -> fn(q, k, v, pt, lens, programs)
    def swapab(**kw):
        return lambda q, k, v, pt, lens, n: decode_attention_swapab(
            q, k, v, pt, lens, num_programs=n, interpret=dry, **kw)
    kernels = {
        "swapab": swapab(),  # 2 workers x 3 stages x 64 keys (the default)
        "swapab_w3s2": swapab(warpgroups=3, stages=2),
        "swapab_w2s2": swapab(warpgroups=2, stages=2),
        "swapab_w1s6": swapab(warpgroups=1, stages=6),
        "swapab_w1s3_k128": swapab(warpgroups=1, stages=3, block_k=128),
        "swapab_n16": swapab(columns=16),  # the group padded to 16 columns, not 8
        "mosaic_rows": lambda q, k, v, pt, lens, n: decode_attention_mgpu(
            q, k, v, pt, lens, num_programs=n, interpret=dry),
        "triton": lambda q, k, v, pt, lens, n: decode_attention(q, k, v, pt, lens,
                                                                num_programs=n,
                                                                interpret=dry),
    }
    if quick or dry:
        kernels = {k: kernels[k] for k in ("swapab", "mosaic_rows", "triton")}

    def quantize(x):  # per-kv-head scale to e4m3's range; NaN pages stay NaN. In the
        # pages' own dtype: no f32 copy of 8 GiB of keys
        sc = (jnp.nanmax(jnp.abs(x), axis=(0, 2, 3)) / 448).astype(x.dtype)
        return (x / sc[None, :, None, None]).astype(jnp.float8_e4m3fn), sc.astype(jnp.float32)

    def fp8_inputs(q, k, v, pt, lens):
        (k8, ks), (v8, vs) = quantize(k), quantize(v)
        return (q, k8, v8, pt, lens, ks, vs)

    kernels["swapab_fp8"] = lambda q, k8, v8, pt, lens, ks, vs, n: decode_attention_swapab(
        q, k8, v8, pt, lens, k_scale=ks, v_scale=vs, num_programs=n, interpret=dry)

    # 3. correctness on the GPU: random lengths (not multiples of a block), poisoned
    # unused pages, and a split-KV case
    rng = np.random.default_rng(0)
    checks, failed = [], set()
    # every kernel on the first case; the kernels of the table's first rows on all
    # (B 16 ctx 4096 takes the default split-KV path, the last case 3 splits)
    check_cases = ((64, 64, 44, None), (7, 19, 66, None), (16, 256, 132, None),
                   (33, 40, 132, 3))
    core = ("swapab", "swapab_fp8", "mosaic_rows", "triton")
    if dry:
        check_cases = ((2, 5, 1, None), (1, 9, 2, 2))
    for ci, (b, max_pages, nprog, splits) in enumerate(check_cases):
        n = b * max_pages + 1
        pt = rng.permutation(n)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
        lens = rng.integers(1, max_pages * PS + 1, b).astype(np.int32)
        k = np.array(jax.random.normal(jax.random.PRNGKey(1), (n, KVH, PS, D), jnp.float32))
        v = np.array(jax.random.normal(jax.random.PRNGKey(2), (n, KVH, PS, D), jnp.float32))
        used = np.zeros(n, bool)
        for i in range(b):
            used[pt[i, : -(-lens[i] // PS)]] = True
        k[~used], v[~used] = np.nan, np.nan
        for i in range(b):
            pt[i, -(-lens[i] // PS):] = np.flatnonzero(~used)[0]
        q = jax.random.normal(jax.random.PRNGKey(3), (b, H, D), jnp.bfloat16)
        k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
        pt, lens = jnp.asarray(pt), jnp.asarray(lens)
        ref = decode_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                         v.astype(jnp.float32), pt, lens)
        fp8_case = fp8_inputs(q, k, v, pt, lens)
        ref8 = decode_attention_reference(
            q.astype(jnp.float32), *(x.astype(jnp.float32) * sc[None, :, None, None]
                                     for x, sc in zip(fp8_case[1:3], fp8_case[5:])), pt, lens)
        for name, fn in kernels.items():
            if (splits is not None and name not in ("swapab", "swapab_fp8")
                    or ci > 0 and name not in core):
                continue
            row = {"kernel": name, "batch": b, "max_context": max_pages * PS,
                   "programs": nprog, "splits": splits}
            progress[1] = f"correctness {row}"
            try:
                if name == "swapab_fp8":
                    o = fn(*fp8_case, nprog) if splits is None else decode_attention_swapab(
                        *fp8_case[:5], k_scale=fp8_case[5], v_scale=fp8_case[6],
                        num_programs=nprog, splits=splits, interpret=dry)
                elif splits is None:
                    o = fn(q, k, v, pt, lens, nprog)
                else:
                    o = decode_attention_swapab(q, k, v, pt, lens, num_programs=nprog,
                                                splits=splits, interpret=dry)
                o = o.astype(jnp.float32)
                row["finite"] = bool(jnp.isfinite(o).all())
                r = ref8 if name == "swapab_fp8" else ref
                row["rel_error"] = float(jnp.linalg.norm(jnp.nan_to_num(o) - r)
                                         / jnp.linalg.norm(r))
                if name.startswith("swapab") or name == "triton":  # they mask poisoned V
                    if not row["finite"] or row["rel_error"] > 1e-2:
                        failed.add(name)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:600]
                failed.add(name)
            checks.append(row)
            print("check", row, flush=True)
            save()
    res["correctness"] = checks
    res["failed_correctness"] = sorted(failed)
    save()

    # 4. compile time for the target shape (lower + compile of one call)
    b0, ctx0 = SHAPES[0]
    q, k, v, pt, lens = make_case(b0, ctx0, PS, rng)
    compile_s = {}
    for name in ("swapab", "mosaic_rows", "triton"):
        fn = kernels[name]
        progress[1] = f"compile {name}"
        t = time.perf_counter()
        try:
            jax.jit(lambda *a, fn=fn: fn(*a, sms)).lower(q, k, v, pt, lens).compile()
            compile_s[name] = time.perf_counter() - t
        except Exception as e:
            compile_s[name] = f"{type(e).__name__}: {e}"[:300]
    res[f"compile_seconds_b{b0}_ctx{ctx0}_full_grid"] = compile_s
    print("compile seconds", compile_s, flush=True)
    save()

    # 5. bandwidth sweeps
    rows = []
    res["rows"] = rows

    def run(name, b, ctx, nprog, case, extra=None):
        if time.perf_counter() - t_start > BUDGET_S:
            rows.append({"kernel": name, "batch": b, "context": ctx, "programs": nprog,
                         "skipped": "time budget"})
            return
        nbytes = 2 * b * ctx * KVH * D * case[1].dtype.itemsize
        progress[1] = f"timing {name} B {b} ctx {ctx} programs {nprog}"
        row = measure({"kernel": name, "batch": b, "context": ctx, "programs": nprog,
                       **(extra or {})},
                      lambda *a: kernels[name](*a, nprog), case, nbytes, bw, timer=timer)
        rows.append(row)
        print(row, flush=True)
        save()

    # order: what matters most first (the budget skips the tail): the full grid, 66 and 44
    # programs at the target shape, then the other shapes, then the other grids
    names = [n for n in kernels if n not in failed]
    case = (q, k, v, pt, lens)
    case8 = fp8_inputs(*case)
    grids = [g for g in sorted(set(GRIDS) | {sms}, reverse=True) if g <= sms]

    def target_shape(grid_list):
        for nprog in grid_list:
            for name in names:
                run(name, b0, ctx0, nprog, case8 if name == "swapab_fp8" else case)

    target_shape([g for g in grids if g in (sms, 66, 44)])
    for b, ctx in SHAPES[1:1 if quick else None]:
        other = make_case(b, ctx, PS, rng)
        for name in names:
            if name == "swapab_fp8":
                other8 = fp8_inputs(*other)
                run(name, b, ctx, sms, other8)
                del other8
            else:
                run(name, b, ctx, sms, other)
        if b * KVH < 2 * sms and "swapab" in names:  # the split count, by measurement
            for splits in (2,) if dry else (2, 4, 8):
                kernels[f"swapab_splits{splits}"] = swapab(splits=splits)
                run(f"swapab_splits{splits}", b, ctx, sms, other)
            res["default_splits_b16"] = default_splits(b, KVH, ctx, sms * 2)
        del other
    target_shape([g for g in grids if g not in (sms, 66, 44)])
    res["seconds_total"] = time.perf_counter() - t_start
    save()

    # the table: fraction of copy bandwidth by kernel and grid
    print("\nfraction of copy bandwidth (copy %.0f GB/s)" % (bw / 1e9))
    cols = sorted({(r["batch"], r["context"], r["programs"]) for r in rows})
    print("%-18s" % "kernel" + "".join("%11s" % f"{b}/{c}@{p}" for b, c, p in cols))
    for name in dict.fromkeys(r["kernel"] for r in rows):
        cells = []
        for col in cols:
            r = [x for x in rows if x["kernel"] == name and
                 (x["batch"], x["context"], x["programs"]) == col]
            cells.append("%10.1f%%" % (100 * r[0]["fraction_of_copy"])
                         if r and "fraction_of_copy" in r[0] else "%11s" % "-")
        print("%-18s" % name + "".join(cells))
    for r in res["torch_sdpa"].get("rows", []):
        if "fraction_of_copy" in r:
            print("torch_sdpa %s/%s on %s SMs: %.1f%%" % (r["batch"], r["context"], r["sms"],
                                                         100 * r["fraction_of_copy"]))
    print("compile seconds", compile_s)


if __name__ == "__main__":
    if sys.argv[1] == "--torch-part":
        torch_part(sys.argv[2], "--quick" in sys.argv)
    else:
        main()
