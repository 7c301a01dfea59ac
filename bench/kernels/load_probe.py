"""Where does a bounded grid lose bandwidth? Streams the same bytes three ways at 66..528
programs and reports GB/s per run (one JSON file):

- triton_contiguous: each program sums contiguous [block, 128] bf16 tiles (Triton);
- triton_paged: the decode kernel's loads exactly (page-table gather of K and V per
  (sequence, kv head)), summed instead of attended (Triton);
- mosaic_contiguous: the contiguous stream through a TMA pipeline into shared memory
  (Mosaic GPU, `plgpu.emit_pipeline`, 2 and 4 stages in flight).

    python bench/kernels/load_probe.py --out bench/results/load_probe_h200.json

Against the decode kernel's rate at the same grid (bench_decode --variants), this says
whether the per-SM ceiling comes from the loads or from the attention arithmetic, and
whether Mosaic GPU's TMA pipeline lifts it (issue 5's backend decision).
"""
from __future__ import annotations

import argparse
import functools
import json

import jax

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from nanojax.profiling.timing import device_seconds
from bench_decode import D, KVH, copy_bandwidth, make_case, measure
from pallas_kernels.device import device_sms


def _triton_params(warps):
    from jax.experimental.pallas import triton as plgpu
    return {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=2)}


def triton_contiguous(x, nprog, block, warps=4, interpret=False):
    """x [R, D]: program p sums tiles p, p + nprog, ... -> [nprog, block, D] f32."""
    r, d = x.shape
    nblocks = r // block

    def kernel(x_ref, o_ref):
        pid = pl.program_id(0)
        n = (nblocks - pid + nprog - 1) // nprog

        def step(i, acc):
            return acc + x_ref[pl.ds((pid + i * nprog) * block, block), :].astype(jnp.float32)

        o_ref[0] = lax.fori_loop(0, n, step, jnp.zeros((block, d), jnp.float32))

    return pl.pallas_call(
        kernel, grid=(nprog,), out_shape=jax.ShapeDtypeStruct((nprog, block, d), jnp.float32),
        out_specs=pl.BlockSpec((1, block, d), lambda p: (p, 0, 0)),
        interpret=interpret, **({} if interpret else _triton_params(warps)))(x)


def triton_paged(k_pages, v_pages, page_table, lens, nprog, block_k, warps=4,
                 interpret=False):
    """The decode kernel's unit loop and gathered loads, summing K + V per unit."""
    n, kvh, ps, d = k_pages.shape
    b = page_table.shape[0]
    ppb = block_k // ps
    num_work = b * kvh

    def kernel(k_ref, v_ref, pt_ref, len_ref, o_ref):
        pid = pl.program_id(0)

        def unit(i, acc):
            w = pid + i * nprog
            bb, h = w // kvh, w % kvh
            nb = (len_ref[bb] + block_k - 1) // block_k

            def step(j, acc):
                idx = pt_ref[bb, pl.ds(j * ppb, ppb)] * kvh + h
                kk = k_ref[idx].reshape(block_k, d).astype(jnp.float32)
                vv = v_ref[idx].reshape(block_k, d).astype(jnp.float32)
                return acc + kk + vv

            return lax.fori_loop(0, nb, step, acc)

        n_units = (num_work - pid + nprog - 1) // nprog
        o_ref[0] = lax.fori_loop(0, n_units, unit, jnp.zeros((block_k, d), jnp.float32))

    return pl.pallas_call(
        kernel, grid=(nprog,), out_shape=jax.ShapeDtypeStruct((nprog, block_k, d), jnp.float32),
        out_specs=pl.BlockSpec((1, block_k, d), lambda p: (p, 0, 0)),
        interpret=interpret, **({} if interpret else _triton_params(warps)),
    )(k_pages.reshape(n * kvh, ps, d), v_pages.reshape(n * kvh, ps, d),
      page_table, lens)


def mosaic_contiguous(x, nprog, block, stages):
    """The contiguous stream with TMA copies, `stages` tiles in flight per program."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    r, d = x.shape
    per = r // block // nprog

    def body(x_gmem, o_gmem, o_smem):
        pid = lax.axis_index("p")

        def step(idx, x_smem, acc):
            return acc + x_smem[...].astype(jnp.float32)

        acc = plgpu.emit_pipeline(
            step, grid=(per,),
            in_specs=[plgpu.BlockSpec((block, d), lambda i: (pid * per + i, 0))],
            max_concurrent_steps=stages,
            init_carry=jnp.zeros((block, d), jnp.float32))(x_gmem)
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pid])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((nprog, block, d), jnp.float32),
                        scratch_types=[plgpu.SMEM((block, d), jnp.float32)],
                        grid=(nprog,), grid_names=("p",))(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/load_probe_h200.json")
    args = ap.parse_args()
    dev = jax.devices()[0]
    sms = device_sms(dev)
    bw = copy_bandwidth()
    res = {"command": "python bench/kernels/load_probe.py --out " + args.out,
           "device": dev.device_kind, "jax": jax.__version__, "num_sms": sms,
           "copy_bandwidth_GBps": bw / 1e9, "rows": []}
    b, ctx, ps = 512, 1024, 16
    q, k, v, pt, lens = make_case(b, ctx, ps, np.random.default_rng(0))
    del q
    nbytes = 2 * b * ctx * KVH * D * 2
    x = jnp.concatenate([k.reshape(-1, D), v.reshape(-1, D)])  # the same bytes, contiguous
    ref = x.astype(jnp.float32).sum()

    def record(name, fn, inputs, **kw):
        row = measure({"probe": name, **kw}, fn, inputs, nbytes, bw,
                      check=lambda out: {"sum_rel_error": float(abs(out.sum() - ref)
                                                                / abs(ref))},
                      timer=lambda f, *a: device_seconds(f, *a, iters=10))
        res["rows"].append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for nprog in (sms // 2, sms, 2 * sms, 4 * sms):
        for block, warps in ((64, 4), (128, 4), (128, 8)):
            record("triton_contiguous", functools.partial(
                triton_contiguous, nprog=nprog, block=block, warps=warps), (x,),
                programs=nprog, block=block, num_warps=warps)
            record("triton_paged", functools.partial(
                triton_paged, nprog=nprog, block_k=block, warps=warps), (k, v, pt, lens),
                programs=nprog, block=block, num_warps=warps)
        for block, stages in ((64, 2), (64, 4), (128, 2), (128, 4)):
            record("mosaic_contiguous", functools.partial(
                mosaic_contiguous, nprog=nprog, block=block, stages=stages), (x,),
                programs=nprog, block=block, stages=stages)
    print("done", flush=True)


if __name__ == "__main__":
    main()
