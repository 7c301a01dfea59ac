"""The FP8 MoE block's two expert-GEMM paths on one GPU (tests/test_fp8_moe.py's Hopper
test case): the Mosaic GPU grouped GEMM ("auto") against XLA's ragged_dot ("xla", jitted
and eager), each one's distance from the float block, and the per-row error between them
(a row sent to the wrong expert would stand out). Prints; one H100 run is in
bench/results/moe/kernels_h100_fp8/ (bench/results/log/fp8.md §98).
Usage: PYTHONPATH=. python3 bench/repro/moe/fp8_block_paths.py
"""
import sys

import jax
import numpy as np

sys.path.insert(0, "tests")
from test_fp8_moe import MoEBlock, _block_params, _cfg, quantize_params  # noqa: E402

cfg = _cfg(0, True, dtype="bfloat16", hidden_size=256, moe_intermediate_size=256)
params, h = _block_params(cfg, tokens=128)
fp8, qcfg = quantize_params(params), cfg.replace(quantization="fp8")
auto = np.asarray(jax.jit(MoEBlock(qcfg).apply)({"params": fp8}, h), np.float64)
xla = np.asarray(jax.jit(MoEBlock(qcfg, grouped_gemm="xla").apply)({"params": fp8}, h),
                 np.float64)
xla_e = np.asarray(MoEBlock(qcfg, grouped_gemm="xla").apply({"params": fp8}, h), np.float64)
flt = np.asarray(MoEBlock(cfg, grouped_gemm="xla").apply({"params": params}, h), np.float64)


def r(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


print("auto-xla_eager", r(auto, xla_e), "auto-xla_jit", r(auto, xla),
      "xlajit-xlaeager", r(xla, xla_e))
print("auto-float", r(auto, flt), "xla-float", r(xla, flt), "xlaeager-float", r(xla_e, flt))
row = np.linalg.norm(auto - xla, axis=1) / np.linalg.norm(xla, axis=1)
print("per-row rel err: max", row.max(), "median", np.median(row), "rows>0.1",
      int((row > 0.1).sum()), np.argsort(row)[-8:])
