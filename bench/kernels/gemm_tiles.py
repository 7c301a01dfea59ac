"""GPU benchmark of the fused kernel's GEMM body (pallas_kernels/fused_gemm_attention_mgpu.py
gemm_part) against XLA's GEMM, over output-tile shapes, at the LLaMA-3-8B nano-batch GEMMs.

    PYTHONPATH=. python3 bench/kernels/gemm_tiles.py --out gemm_tiles.json

Why: at 1,024 tokens qkv (N 6144) has 8 x 24 = 192 output tiles of 128 x 256 for 132
programs, two waves of which the second is half empty, and the GEMM part ran 1.18-1.21x
XLA's GEMM there (bench/results/log/overlap_search.md §65, §67). Tiles of 128 x 128 give
384 tiles, 2.9 waves. Each row: a GEMM, a tile shape, the full grid, its time and its
ratio over XLA's.
"""
from __future__ import annotations

import argparse
import json

from nanojax.profiling.pair_record import GEMMS
from pallas_kernels.device import device_sms

# (tile_m, tile_n a consumer warpgroup, tile_k, K steps in flight): the CTA's output tile
# is tile_m x 2 tile_n
TILES = {"128x256": (128, 128, 64, 4), "128x128": (128, 64, 64, 4),
         "128x128_s6": (128, 64, 64, 6)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--gemms", default=",".join(GEMMS), help=f"subset of {', '.join(GEMMS)}")
    p.add_argument("--tokens", default="1024,2048", help="GEMM rows M, comma-separated")
    p.add_argument("--tiles", default=",".join(TILES), help=f"subset of {', '.join(TILES)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    args.gemms, args.tiles = args.gemms.split(","), args.tiles.split(",")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens must be integers separated by commas, got {args.tokens!r}")
    if any(t <= 0 or t % 128 for t in args.tokens):
        p.error(f"--tokens must be positive multiples of 128 (the tile rows), got {args.tokens}")
    for name, known in (("gemm", GEMMS), ("tile", TILES)):
        bad = [x for x in getattr(args, name + "s") if x not in known]
        if bad:
            p.error(f"unknown {name} {bad}; choose from {list(known)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    from nanojax.profiling.record import environment
    from nanojax.profiling.timing import device_seconds
    from pallas_kernels import fused_gemm_attention_mgpu as fused
    n_prog = device_sms()
    rows = []
    for m in args.tokens:
        for name in args.gemms:
            k, n = GEMMS[name]
            ka, kb = jax.random.split(jax.random.PRNGKey(1))
            a = jax.random.normal(ka, (m, k), jnp.bfloat16)
            b = jax.random.normal(kb, (k, n), jnp.bfloat16) * k ** -0.5
            xla = device_seconds(jnp.dot, a, b, iters=args.iters, reps=args.reps) * 1e3
            ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
            for tile in args.tiles:
                tm, tn, tk, steps = TILES[tile]
                cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk,
                                      max_concurrent_steps=steps, epi_tile_m=64,
                                      epi_tile_n=64)
                tiles = (m // tm) * (n // (2 * tn))
                row = {"gemm": name, "m": m, "k": k, "n": n, "tile": tile, "tiles": tiles,
                       "waves": tiles / n_prog, "xla_ms": xla}
                try:
                    fn = lambda x, y, cfg=cfg: fused.gemm_part(x, y, config=cfg)  # noqa: E731
                    got = fn(a, b)
                    row["rel_error"] = float(jnp.linalg.norm(got.astype(jnp.float32) - ref)
                                             / jnp.linalg.norm(ref))
                    row["ms"] = device_seconds(fn, a, b, iters=args.iters,
                                               reps=args.reps) * 1e3
                    row["over_xla"] = row["ms"] / xla
                    row["wave_efficiency"] = fused.wave_fill(m, n, 2 * tn, n_prog, tm)
                except Exception as e:  # noqa: BLE001  (recorded: a shape that does not fit)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    out = {"command": "bench/kernels/gemm_tiles.py", "args": vars(args), "programs": n_prog,
           "environment": environment(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
