"""GPU benchmark of the fused GEMM + decode-attention kernel (one launch split by program
id, pallas_kernels/fused_gemm_attention_mgpu.py) against its parts and against the two
back to back; writes one JSON file.

    PYTHONPATH=. python3 bench/kernels/fused_pair.py --out bench/results/fused_pair_h200.json

At the LLaMA-3-8B nano-batch shapes of B_dense 2048 (a GEMM nano-batch of --tokens 1024
tokens: qkv, o, gate_up or down; a decode nano-batch of --batch 512 sequences of --ctx
1024 keys, 32/8 heads, D 128, pages of 16), for each GEMM and each GEMM share G of the N
programs (one per SM):
  gemm_g       the fused kernel's GEMM body alone on G programs (gemm_part)
  attention_g  the swap-AB attention alone on N - G programs, 3 workers a program (the
               fused kernel's attention body)
  fused        the pair in one launch, GEMM on programs [0, G)
and once per GEMM at the full grid:
  xla_gemm, gemm_part_full (the GEMM body on N programs: the "within 10% of XLA" check),
  attention_full (swap-AB on N programs, its default workers), back_to_back (XLA's GEMM
  then the full-grid attention, in one jitted function).
Ratios: back_to_back / fused (> 1: the fused pair pays), fused / max(gemm_g, attention_g)
(1: the two sides do not slow each other), gemm_part_full / xla_gemm.

Times: nanojax.profiling.timing.device_seconds (--iters calls in one jitted loop, median
of --reps). SM clock and power: `nvidia-smi --query-gpu=clocks.sm,power.draw` sampled
every --sample-ms in a background thread while each case runs for --power-seconds (its
own loop, after the timing); absent when nvidia-smi is not there.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
         "down": (14336, 4096)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--gemms", default=",".join(GEMMS),
                   help=f"comma-separated subset of {', '.join(GEMMS)}")
    p.add_argument("--shares", default="44,66,88,110",
                   help="GEMM programs G of the fused kernel, comma-separated")
    p.add_argument("--programs", type=int, default=None,
                   help="programs N of the fused kernel (default: the SM count)")
    p.add_argument("--tokens", type=int, default=1024, help="GEMM rows (nano-batch tokens)")
    p.add_argument("--batch", type=int, default=512, help="decode sequences")
    p.add_argument("--ctx", type=int, default=1024, help="keys per decode sequence")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--power-seconds", type=float, default=2.0,
                   help="how long each case runs while clock and power are sampled (0: off)")
    p.add_argument("--sample-ms", type=int, default=50)
    p.add_argument("--gpu-index", type=int, default=0, help="nvidia-smi's index of the GPU")
    args = p.parse_args(argv)
    bad = [g for g in args.gemms.split(",") if g not in GEMMS]
    if bad:
        p.error(f"--gemms: unknown {bad}; choose from {list(GEMMS)}")
    return args


class PowerSampler:
    """nvidia-smi's SM clock (MHz) and board power (W), every `ms`, in a background thread
    between start() and stop(); stop() returns their summary (None without nvidia-smi)."""

    def __init__(self, gpu_index: int, ms: int):
        self.cmd = ["nvidia-smi", "-i", str(gpu_index), "--query-gpu=clocks.sm,power.draw",
                    "--format=csv,noheader,nounits", f"--loop-ms={ms}"]
        self.samples, self.proc, self.thread = [], None, None

    def start(self):
        self.samples = []
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        except (FileNotFoundError, PermissionError):
            self.proc = None
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                clock, power = (float(x) for x in line.split(","))
            except ValueError:  # "[N/A]" or a partial line
                continue
            self.samples.append((clock, power))

    def stop(self) -> dict | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=2)
        if not self.samples:
            return {"samples": 0}
        clocks, powers = zip(*self.samples)
        return {"samples": len(self.samples),
                "sm_clock_mhz_mean": sum(clocks) / len(clocks), "sm_clock_mhz_min": min(clocks),
                "power_w_mean": sum(powers) / len(powers), "power_w_max": max(powers)}


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
    shares = [int(s) for s in args.shares.split(",")]
    kvh, group, d, ps = 8, 4, 128, 16
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
        row = {"case": name, "ms": t * 1e3,
               "power": sustained(fn, fargs, args.power_seconds, sampler)}
        print(f"{name:>40s} {t * 1e3:8.3f} ms", flush=True)
        return row

    result = {"command": " ".join(["python3"] + sys.argv), "device": str(dev),
              "programs": n_prog, "tokens": args.tokens, "batch": args.batch,
              "ctx": args.ctx, "heads": [kvh * group, kvh], "head_dim": d, "page_size": ps,
              "attention_workers_fused": WARPGROUPS, "gemms": {}}
    att_full = measure("attention_full", lambda *x: decode_attention_swapab(
        *x, num_programs=n_prog), att)
    result["attention_full"] = att_full
    for name in args.gemms.split(","):
        kdim, ndim = GEMMS[name]
        ka, kb = jax.random.split(jax.random.PRNGKey(1))
        a = jax.random.normal(ka, (args.tokens, kdim), jnp.bfloat16)
        b = jax.random.normal(kb, (kdim, ndim), jnp.bfloat16) * kdim ** -0.5
        xla = measure(f"{name} xla_gemm", jnp.dot, (a, b))
        part = measure(f"{name} gemm_part_full", lambda x, y: gemm_part(
            x, y, num_programs=n_prog), (a, b))
        b2b = measure(f"{name} back_to_back", lambda x, y, *r: (
            jnp.dot(x, y), decode_attention_swapab(*r, num_programs=n_prog)), (a, b, *att))
        rows = []
        for g in shares:
            gemm_g = measure(f"{name} gemm G={g}", lambda x, y, g=g: gemm_part(
                x, y, num_programs=g), (a, b))
            att_g = measure(f"{name} attention {n_prog - g}", lambda *x, g=g: (
                decode_attention_swapab(*x, num_programs=n_prog - g, warpgroups=WARPGROUPS)),
                att)
            fused = measure(f"{name} fused G={g}", lambda *x, g=g: fused_gemm_attention(
                *x, gemm_programs=g, num_programs=n_prog), (a, b, *att))
            rows.append({"G": g, "gemm": gemm_g, "attention": att_g, "fused": fused,
                         "back_to_back_over_fused": b2b["ms"] / fused["ms"],
                         "fused_over_slower_part": fused["ms"] / max(gemm_g["ms"],
                                                                     att_g["ms"])})
        result["gemms"][name] = {
            "k": kdim, "n": ndim, "xla_gemm": xla, "gemm_part_full": part,
            "gemm_part_full_over_xla": part["ms"] / xla["ms"], "back_to_back": b2b,
            "shares": rows,
            "best_G": max(rows, key=lambda r: r["back_to_back_over_fused"])["G"]}
        # checked once per GEMM, so a wrong kernel cannot pass as a fast one
        c, o = fused_gemm_attention(a, b, *att, gemm_programs=shares[0], num_programs=n_prog)
        ref_c = np.asarray(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
        ref_o = np.asarray(decode_attention_swapab(*att, num_programs=n_prog), np.float32)
        result["gemms"][name]["fused_rel_error"] = {
            "gemm": float(np.linalg.norm(np.asarray(c, np.float32) - ref_c)
                          / np.linalg.norm(ref_c)),
            "attention_vs_swapab": float(np.linalg.norm(np.asarray(o, np.float32) - ref_o)
                                         / np.linalg.norm(ref_o))}
        with open(args.out, "w") as f:  # after each GEMM: a partial run keeps its rows
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
