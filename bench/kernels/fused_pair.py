"""GPU benchmark of the fused GEMM + decode-attention kernel (one launch split by program
id, pallas_kernels/fused_gemm_attention_mgpu.py) against its parts and against the two
back to back; writes one JSON file (layout: pair_record.py, shared with the PyTorch
green-context reference green_context_pair.py).

    PYTHONPATH=. python3 bench/kernels/fused_pair.py --out bench/results/fused_pair_h200.json

Both benches and the plot (plot_fused_pair.py) in one GPU call, into $OUT:
`OUT=dir bash bench/scripts/fused_pair_gpu.sh`.

At the LLaMA-3-8B nano-batch shapes of B_dense 2048 (a GEMM nano-batch of --tokens 1024
tokens: qkv, o, gate_up or down; a decode nano-batch of --batch 512 sequences of --ctx
1024 keys, 32/8 heads, D 128, pages of 16), for each GEMM and each GEMM share G of the N
programs (one per SM), a row of "shares" with:
  gemm       the fused kernel's GEMM body alone on G programs (gemm_part)
  attention  the swap-AB attention alone on N - G programs, 3 workers a program (the
             fused kernel's attention body; measured once per G, the same in each GEMM)
  pair       the fused pair in one launch, GEMM on programs [0, G)
(a share that fails records {"G", "error"}) and once per GEMM at the full grid:
  xla_gemm, gemm_part_full (the GEMM body on N programs: the "within 10% of XLA" check),
  attention_full (swap-AB on N programs, its default workers), back_to_back (XLA's GEMM
  then the full-grid attention, in one jitted function).
Ratios: back_to_back_over_pair (> 1: the fused pair pays), pair_over_slower_part
(1: the two sides do not slow each other), gemm_part_full_over_xla.

Times: nanojax.profiling.timing.device_seconds (--iters calls in one jitted loop, median
of --reps). SM clock, power and throttle reasons: nvidia-smi queried every --sample-ms in
a background thread while each case runs for --power-seconds (its own loop, after the
timing; pair_record.PowerSampler); absent when nvidia-smi is not there.
"""
from __future__ import annotations

import json
import sys
import time

from pair_record import (GEMMS, HEAD_DIM, KV_HEADS, Q_HEADS, PowerSampler, add_share,
                         make_parser, case, check_args, error_row, gemm_entry, header,
                         share_row)


def parse_args(argv=None):
    p = make_parser(__doc__)
    p.add_argument("--programs", type=int, default=None,
                   help="programs N of the fused kernel (default: the SM count)")
    return check_args(p, p.parse_args(argv))


def sustained(fn, args, seconds: float, sampler: PowerSampler | None):
    """Run fn over and over for `seconds` (a jitted loop of calls, compiled first) while
    the sampler records; its summary."""
    import jax
    from jax import lax
    if sampler is None or seconds <= 0:
        return None

    @jax.jit
    def loop(a):
        def body(i, carry):
            x, _ = lax.optimization_barrier(carry)
            return x, fn(*x)
        zeros = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                                       jax.eval_shape(fn, *a))
        return lax.fori_loop(0, 20, body, (a, zeros))[1]

    jax.block_until_ready(loop(args))
    sampler.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready(loop(args))
    return sampler.stop()


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nanojax.profiling.timing import device_seconds
    from pallas_kernels.decode_attention_swapab import decode_attention_swapab
    from pallas_kernels.fused_gemm_attention_mgpu import (WARPGROUPS, fused_gemm_attention,
                                                          gemm_part)
    dev = jax.devices()[0]
    n_prog = args.programs or getattr(dev, "core_count", None) or 132
    kvh, group, d, ps = KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM, 16
    sampler = PowerSampler(args.gpu_index, args.sample_ms) if args.power_seconds > 0 else None

    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    n_pages = args.batch * args.ctx // ps
    q = jax.random.normal(ks[0], (args.batch, kvh * group, d), jnp.bfloat16)
    k_pages = jax.random.normal(ks[1], (n_pages, kvh, ps, d), jnp.bfloat16)
    v_pages = jax.random.normal(ks[2], (n_pages, kvh, ps, d), jnp.bfloat16)
    page_table = jax.random.permutation(ks[3], n_pages).reshape(args.batch, -1).astype(
        jnp.int32)
    lens = jnp.full((args.batch,), args.ctx, jnp.int32)
    att = (q, k_pages, v_pages, page_table, lens)

    def measure(name, fn, fargs):
        t = device_seconds(fn, *fargs, iters=args.iters, reps=args.reps)
        print(f"{name:>40s} {t * 1e3:8.3f} ms", flush=True)
        return case(name, t * 1e3, sustained(fn, fargs, args.power_seconds, sampler))

    def rel_error(a, b, g):
        c, o = fused_gemm_attention(a, b, *att, gemm_programs=g, num_programs=n_prog)
        ref_c = np.asarray(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
        ref_o = np.asarray(decode_attention_swapab(*att, num_programs=n_prog), np.float32)
        return {"G": g,
                "gemm": float(np.linalg.norm(np.asarray(c, np.float32) - ref_c)
                              / np.linalg.norm(ref_c)),
                "attention_vs_swapab": float(np.linalg.norm(np.asarray(o, np.float32) - ref_o)
                                             / np.linalg.norm(ref_o))}

    result = header("nanojax fused launch", " ".join(["python3"] + sys.argv), str(dev),
                    n_prog, args, page_size=ps, attention_workers_fused=WARPGROUPS,
                    kv_layout="pages of 16 keys, page table a random permutation")
    att_full = measure("attention_full", lambda *x: decode_attention_swapab(
        *x, num_programs=n_prog), att)
    result["attention_full"] = att_full
    att_alone = {}  # the attention alone on N - G programs is the same beside every GEMM
    for name in args.gemms:
        kdim, ndim = GEMMS[name]
        ka, kb = jax.random.split(jax.random.PRNGKey(1))
        a = jax.random.normal(ka, (args.tokens, kdim), jnp.bfloat16)
        b = jax.random.normal(kb, (kdim, ndim), jnp.bfloat16) * kdim ** -0.5
        xla = measure(f"{name} xla_gemm", jnp.dot, (a, b))
        part = measure(f"{name} gemm_part_full", lambda x, y: gemm_part(
            x, y, num_programs=n_prog), (a, b))
        b2b = measure(f"{name} back_to_back", lambda x, y, *r: (
            jnp.dot(x, y), decode_attention_swapab(*r, num_programs=n_prog)), (a, b, *att))
        entry = result["gemms"][name] = gemm_entry(
            name, b2b, xla_gemm=xla, gemm_part_full=part,
            gemm_part_full_over_xla=part["ms"] / xla["ms"])
        for g in args.shares:
            try:  # one share that fails to compile or run leaves the others measured
                gemm_g = measure(f"{name} gemm G={g}", lambda x, y, g=g: gemm_part(
                    x, y, num_programs=g), (a, b))
                if g not in att_alone:
                    att_alone[g] = measure(f"attention {n_prog - g}", lambda *x, g=g: (
                        decode_attention_swapab(*x, num_programs=n_prog - g,
                                                warpgroups=WARPGROUPS)), att)
                att_g = att_alone[g]
                fused = measure(f"{name} fused G={g}", lambda *x, g=g: fused_gemm_attention(
                    *x, gemm_programs=g, num_programs=n_prog), (a, b, *att))
                add_share(entry, share_row(g, g, n_prog - g, gemm_g, att_g, fused, b2b))
            except Exception as e:  # noqa: BLE001  (recorded in the JSON)
                print(f"{name} G={g}: {e!r}"[:300], flush=True)
                add_share(entry, error_row(g, e))
        # checked once per GEMM at its best share, so a wrong kernel cannot pass as a fast one
        entry["fused_rel_error"] = ({"error": "no share ran"} if entry["best_G"] is None
                                    else rel_error(a, b, entry["best_G"]))
        with open(args.out, "w") as f:  # after each GEMM: a partial run keeps its rows
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
