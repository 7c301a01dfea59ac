"""Which grouped GEMM does this jax give jax.lax.ragged_dot on this GPU? Times the MoE
block's expert GEMM (Mixtral-8x7B gate projection: rows sorted by expert, 8 groups) as
ragged_dot (XLA's default: a masked dense dot on NVIDIA GPUs), with XLA's cuDNN ragged-dot
fusion (what nanojax compiles MoE steps with on a GPU), with jax's Pallas Triton lowering
where this jax has it, against one dense
GEMM of the same rows (the grouped GEMM's ideal) and the all-experts dense product (what a
masked rewrite costs). Usage: python bench/scripts/moe_grouped_gemm_probe.py OUT.json
[--small] (--small: toy shapes, a CPU smoke run of the script itself)
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.profiling.timing import device_seconds
from nanojax.models.moe import RAGGED_DOT_FUSION

def main(out: str, small: bool = False) -> None:
    from jax._src import config as jax_config
    triton_lowering = getattr(jax_config, "jax_ragged_dot_use_gpu_pallas_triton_lowering", None)
    E, H, F = (8, 256, 512) if small else (8, 4096, 14336)
    rows = {}
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (E, H, F), jnp.bfloat16)
    for b_dense in (512, 1024, 2048):
        m = b_dense * 2  # top-2: every token is two rows
        x = jax.random.normal(key, (m, H), jnp.bfloat16)
        sizes = jnp.asarray(np.diff(np.linspace(0, m, E + 1).astype(int)), jnp.int32)
        flops = 2 * m * H * F
        r = {"rows": m, "active_tflop": flops / 1e12}
        r["ragged_dot_s"] = device_seconds(jax.jit(jax.lax.ragged_dot), x, w, sizes)
        # as nanojax compiles MoE steps on a GPU (models/moe.py): cuDNN's grouped GEMM
        r["ragged_dot_cudnn_fusion_s"] = device_seconds(
            jax.jit(jax.lax.ragged_dot), x, w, sizes,
            compiler_options={RAGGED_DOT_FUSION: True})
        try:
            if triton_lowering is None:
                raise NotImplementedError("no jax_ragged_dot_use_gpu_pallas_triton_lowering")
            with triton_lowering(True):
                r["ragged_dot_pallas_triton_s"] = device_seconds(
                    jax.jit(jax.lax.ragged_dot), x, w, sizes)
        except Exception as e:  # this jax has no such lowering
            r["ragged_dot_pallas_triton_s"] = f"{type(e).__name__}: {str(e)[:200]}"
        r["dense_same_rows_s"] = device_seconds(jnp.dot, x, w[0])
        r["all_experts_dense_s"] = device_seconds(
            jax.jit(lambda x, w: jnp.einsum("mh,ehf->mf", x, w)), x, w)
        for k in list(r):
            if k.endswith("_s") and isinstance(r[k], float):
                r[k[:-2] + "_tflops"] = flops / r[k] / 1e12
        rows[b_dense] = r
        print(b_dense, json.dumps(r), flush=True)
    text = jax.jit(jax.lax.ragged_dot).lower(x, w, sizes).compile().as_text()
    verdict = {"hlo_has_custom_call": "custom-call" in text,
               "hlo_ops": sorted({ln.split("=")[1].split("(")[0].strip().split(" ")[-1]
                                  for ln in text.splitlines() if " = " in ln})[:60]}
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
               "results": rows, "compiled": verdict}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], "--small" in sys.argv[2:])
