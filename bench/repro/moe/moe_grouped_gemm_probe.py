"""The MoE expert GEMM on this GPU: XLA's ragged_dot (a masked dense dot on NVIDIA GPUs),
the Mosaic GPU grouped GEMM (pallas_kernels/grouped_matmul_mgpu.py) at a few tilings, and
one dense GEMM of the same rows (the grouped GEMM's ideal), at the Mixtral-8x7B gate/up
and down shapes for B_dense 512-2048 at top-2, with balanced groups; plus the kernel's
error against the f32 reference on uneven groups with empty ones. Decode-sized batches
(64-256 tokens: 16-64 rows per expert) are where the engine spends a small-batch run; there
it also times gate and up as one GEMM of twice the width, and reading the experts' weights
once (a reduction over them: the floor a memory-bound GEMM cannot beat).
Usage: python bench/repro/moe/moe_grouped_gemm_probe.py OUT.json [--small]
(--small: toy shapes, a smoke run of the script on a GPU)
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.profiling.timing import device_seconds
from pallas_kernels.grouped_matmul_mgpu import (GroupedTiling, grouped_matmul_mgpu,
                                                grouped_matmul_reference)

TILINGS = {"128x128x64s4": GroupedTiling(),
           "64x128x64s6": GroupedTiling(block_m=64, max_concurrent_steps=6),
           "64x256x64s4": GroupedTiling(block_m=64, block_n=256),
           "128x256x64s3": GroupedTiling(block_n=256, max_concurrent_steps=3)}
TOKENS = (64, 128, 256, 512, 2048)  # B_dense or a decode batch; top-2: 2 rows each
DECODE_TOKENS = 256  # up to here also the fused gate+up width and the weight-read floor


def _timed(f, *args) -> float | str:
    try:
        return device_seconds(f, *args)
    except Exception as e:  # a tiling that does not fit (shared memory) or lower
        return f"{type(e).__name__}: {str(e)[:200]}"


def main(out: str, small: bool = False) -> None:
    E, H, F = (8, 256, 512) if small else (8, 4096, 14336)
    key = jax.random.PRNGKey(0)
    rows = {}
    for name, (k, n) in {"gate_up": (H, F), "down": (F, H), "gate_up_fused": (H, 2 * F)}.items():
        w = (jax.random.normal(key, (E, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
        read_s = _timed(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), w)
        for b_dense in TOKENS:
            if name == "gate_up_fused" and not 64 < b_dense <= DECODE_TOKENS:
                continue
            m = b_dense * 2  # top-2: every token is two rows
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            sizes = jnp.full((E,), m // E, jnp.int32)
            flops = 2 * m * k * n
            r = {"rows": m, "k": k, "n": n, "tflop": flops / 1e12,
                 "xla_ragged_dot_s": _timed(jax.jit(jax.lax.ragged_dot), x, w, sizes),
                 "dense_same_rows_s": _timed(jax.jit(jnp.dot), x, w[0]),
                 "weights_read_s": read_s, "weights_gb": w.size * 2 / 1e9}
            for t_name, tiling in TILINGS.items():
                r[f"mosaic_{t_name}_s"] = _timed(
                    jax.jit(lambda a, b, s, t=tiling: grouped_matmul_mgpu(a, b, s, tiling=t)),
                    x, w, sizes)
            for key_ in list(r):
                if key_.endswith("_s") and key_ != "weights_read_s" and isinstance(r[key_], float):
                    r[key_[:-2] + "_tflops"] = flops / r[key_] / 1e12
            rows[f"{name}_{b_dense}"] = r
            print(name, b_dense, json.dumps({a: (round(b, 1) if isinstance(b, float) else b)
                                             for a, b in r.items() if a.endswith("tflops")}),
                  "us:", {a[:-2]: round(1e6 * b) for a, b in r.items()
                          if a.endswith("_s") and isinstance(b, float)},
                  flush=True)
    # correctness on uneven groups, some empty, against the f32 reference
    m, k, n = (512, 256, 512) if small else (4096, 4096, 2048)
    sizes = np.array([0, 1000, 24, 0, 129, 2500, 0, 443]) * m // 4096
    sizes[-1] += m - sizes.sum()
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = (jax.random.normal(key, (E, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    g = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(grouped_matmul_mgpu(x, w, g), np.float64)
    ref = np.asarray(grouped_matmul_reference(x, w, g), np.float64)
    check = {"group_sizes": sizes.tolist(), "finite": bool(np.isfinite(got).all()),
             "rel_error": float(np.linalg.norm(got - ref) / np.linalg.norm(ref))}
    print("check", json.dumps(check), flush=True)
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
               "command": " ".join(sys.argv), "results": rows, "check": check},
              open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], "--small" in sys.argv[2:])
