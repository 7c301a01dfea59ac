"""Does a bounded GEMM beside a bounded decode attention beat the two one after the other?

The question NanoFlow's overlap stands on, asked on this stack without the rest of the
step: one nano-batch's MLP GEMMs (1,024 tokens of the LLaMA-3-8B shape: gate_up, then down)
and another nano-batch's decode attention (1,024 decodes of context 1,024, the Mosaic GPU
kernel), each alone at several grids, then side by side on two streams in one XLA
scheduling group, against the two run back to back at full grid. GEMMs: XLA's (cuBLAS, every
SM) and pallas_kernels/matmul_mgpu.py on a bounded grid. Each timing is `CHAIN` copies
chained in one jitted call (pairs in sequence, the two halves of a pair free to overlap),
median of repeats; one process, so the ratios compare like with like.

    PYTHONPATH=. python3 bench/repro/overlap_search/bounded_overlap_probe.py OUT.json [--quick]
"""
import json
import sys
import time

from nanojax.pipeline.streams import add_stream_xla_flags

add_stream_xla_flags()  # XLA reads its flags when the backend starts: before any jax call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nanojax.profiling.timing import device_seconds  # noqa: E402
from nanojax.pipeline.streams import (carry_metadata_to_stream_calls, on_stream,  # noqa: E402
                                      scheduling_group)
from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu  # noqa: E402
from pallas_kernels.matmul_mgpu import matmul_mgpu, matmul_reference  # noqa: E402
from pallas_kernels.device import device_sms  # noqa: E402

TOKENS, HIDDEN, FFN = 1024, 4096, 14336
CTX, PAGE, KVH, GROUP, D = 1024, 16, 8, 4, 128
CHAIN, REPS = 8, 7


def operands(key):
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (TOKENS, HIDDEN), jnp.bfloat16)
    w1 = jax.random.normal(ks[1], (HIDDEN, 2 * FFN), jnp.bfloat16) * HIDDEN ** -0.5
    w2 = jax.random.normal(ks[2], (FFN, HIDDEN), jnp.bfloat16) * FFN ** -0.5
    pages = TOKENS * CTX // PAGE
    q = jax.random.normal(ks[3], (TOKENS, KVH * GROUP, D), jnp.bfloat16)
    k = jax.random.normal(ks[4], (pages, KVH, PAGE, D), jnp.bfloat16)
    v = jax.random.normal(ks[5], (pages, KVH, PAGE, D), jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(pages)
                        .reshape(TOKENS, CTX // PAGE).astype(np.int32))
    lens = jnp.full((TOKENS,), CTX, jnp.int32)
    return (x, w1, w2), (q, k, v, table, lens)


def mlp(programs):
    """gate_up then down (the SiLU-and-multiply between them is elementwise: left out)."""
    def f(x, w1, w2):
        if programs is None:  # XLA's dot: cuBLAS on every SM
            return jnp.dot(jnp.dot(x, w1)[:, :FFN], w2)
        h = matmul_mgpu(x, w1, num_programs=programs)
        return matmul_mgpu(h[:, :FFN], w2, num_programs=programs)
    return f


def attention(programs):
    return lambda q, k, v, table, lens: decode_attention_mgpu(q, k, v, table, lens,
                                                              num_programs=programs)


def chained(pair):
    """CHAIN pairs in one call; each pair waits for the previous one (optimization
    barrier), the two halves of a pair only for their own inputs. Every pair's output is
    returned: a first version returned the last one only and XLA dropped the other pairs
    (8 pairs timed as fast as one GEMM + one attention)."""
    def f(g_args, a_args):
        outs = []
        for i in range(CHAIN):
            if outs:
                (g_args, a_args), _ = jax.lax.optimization_barrier(((g_args, a_args),
                                                                     outs[-1]))
            outs.append(pair(i, g_args, a_args))
        return outs
    return jax.jit(f)


def seconds_per_pair(fn, g_args, a_args) -> float:
    jax.block_until_ready(fn(g_args, a_args))
    ts = []
    for _ in range(REPS):
        t = time.perf_counter()
        jax.block_until_ready(fn(g_args, a_args))
        ts.append((time.perf_counter() - t) / CHAIN)
    return float(np.median(ts))


def side_by_side(gemm, att):
    def pair(i, g_args, a_args):
        with scheduling_group(i + 1):
            o = on_stream(att, 1)(*a_args)
            return on_stream(gemm, 2)(*g_args), o
    return chained(pair)


def back_to_back(gemm, att):
    return chained(lambda i, g_args, a_args: (gemm(*g_args), att(*a_args)))


def main():
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    sms = device_sms()
    g_args, a_args = operands(jax.random.PRNGKey(0))
    res = {"command": "python3 bench/repro/overlap_search/bounded_overlap_probe.py " + " ".join(sys.argv[1:]),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__, "num_sms": sms,
           "gemm": f"[{TOKENS},{HIDDEN}]x[{HIDDEN},{2 * FFN}] then [{TOKENS},{FFN}]x[{FFN},{HIDDEN}]",
           "attention": f"{TOKENS} decodes x ctx {CTX}, {KVH}x{GROUP} heads, D {D}, page {PAGE}",
           "groups_on_stream_calls": carry_metadata_to_stream_calls(), "alone": {}, "pairs": []}

    def save():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    def record(key, fn, args):
        try:
            res["alone"][key] = device_seconds(fn, *args, iters=10)
        except Exception as e:  # a variant that fails is a result too
            res["alone"][key] = f"{type(e).__name__}: {e}"[:400]
        print(key, res["alone"][key], flush=True)
        save()

    ref = matmul_reference(g_args[0], g_args[1])
    got = matmul_mgpu(g_args[0], g_args[1], num_programs=sms // 2)
    res["matmul_mgpu_rel_error"] = float(jnp.linalg.norm(got.astype(jnp.float32) - ref)
                                         / jnp.linalg.norm(ref))
    gemm_grids = (None, sms, sms // 2) if quick else (None, sms, 3 * sms // 4, sms // 2,
                                                       sms // 4)
    att_grids = (sms, sms // 2) if quick else (sms, 3 * sms // 4, sms // 2, sms // 4)
    for p in gemm_grids:
        record(f"gemm_{'xla' if p is None else p}", mlp(p), g_args)
    for p in att_grids:
        record(f"attention_{p}", attention(p), a_args)
    combos = [(None, sms), (None, sms // 2), (sms // 2, sms // 2)]
    if not quick:
        combos += [(3 * sms // 4, sms // 4), (sms // 4, 3 * sms // 4), (sms, sms)]
    base = None
    for gp, ap in [(None, sms)] + combos:
        row = {"gemm_programs": gp or "xla", "attention_programs": ap}
        try:
            if base is None:
                base = seconds_per_pair(back_to_back(mlp(None), attention(sms)), g_args,
                                        a_args)
                row.update(mode="back_to_back", seconds=base)
            else:
                t = seconds_per_pair(side_by_side(mlp(gp), attention(ap)), g_args, a_args)
                row.update(mode="side_by_side", seconds=t, speedup_over_back_to_back=base / t)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        res["pairs"].append(row)
        print(row, flush=True)
        save()
    print("done", flush=True)


if __name__ == "__main__":
    main()
