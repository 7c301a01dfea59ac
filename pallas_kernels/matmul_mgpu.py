"""Dense 16-bit matmul on a bounded grid (a GEMM's resource share), Mosaic GPU (Hopper).

Why: NanoFlow gives each kernel of an overlapped pair a share of the SMs. Our decode
attention takes one (decode_attention_mgpu.py: R x SMs programs), but XLA's cuBLAS GEMMs
launch on every SM, so beside it the two streams' kernels mostly alternate and the GEMMs
slow down (the 8-layer timeline: bench/results/log/step.md). A GEMM
whose persistent grid is the other (1 - R) x SMs leaves the attention's SMs alone.

The kernel body is jax's own Hopper matmul (`jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu.kernel`): a TMA pipeline over K feeding WGMMA in two consumer warp
groups, and a loop of output tiles over whatever grid it is launched on. Its `matmul`
always launches one program per SM; this module launches it on `num_programs`, checks
the shapes it can tile, and keeps the pure-JAX reference beside it. Checked against the
reference in Mosaic GPU's interpret mode on the CPU (tests/test_matmul_mgpu.py) and timed
on the H200, on a full grid as fast as cuBLAS (bench/results/bounded_overlap_probe_h200.json,
bench/results/log/overlap_search.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.device import device_sms
from pallas_kernels.mosaic_gpu_support import interpret_params


def default_config():
    """128 x 256 output tiles (two warp groups of 128 x 128), 64-wide K steps, 4 in flight:
    fits the H200's 227 KB of shared memory (lowered for CUDA on the CPU; 128 x 512 tiles
    do not fit)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    return hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                           epi_tile_m=64, epi_tile_n=64)


def unsupported(a, b, config=None) -> str | None:
    """Why the kernel cannot take these operands (None when it can)."""
    config = config or default_config()
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        return f"needs [M, K] x [K, N], got {a.shape} x {b.shape}"
    if a.dtype != b.dtype or jnp.dtype(a.dtype).itemsize != 2:
        return f"needs two 16-bit operands of one dtype, got {a.dtype} and {b.dtype}"
    (m, k), n = a.shape, b.shape[1]
    # the two consumer warp groups split the tile along N (the config's wg_dimension)
    tm, tn = config.tile_m, config.tile_n * 2
    for name, size, tile in (("M", m, tm), ("N", n, tn), ("K", k, config.tile_k)):
        if size % tile:
            return f"{name} = {size} is not a multiple of the {tile} tile"
    return None


@functools.partial(jax.jit, static_argnames=("num_programs", "config", "interpret"))
def matmul_mgpu(a, b, *, num_programs: int | None = None, config=None,
                interpret: bool = False):
    """a [M, K] @ b [K, N] -> [M, N] in a's dtype (f32 accumulation), on `num_programs`
    programs (None: one per SM); each program walks output tiles until none is left."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    config = config or default_config()
    if (why := unsupported(a, b, config)) is not None:
        raise ValueError(why)
    if num_programs is None:
        num_programs = device_sms()
    (m, _), n = a.shape, b.shape[1]
    tiles = (m // config.tile_m) * (n // (config.tile_n * 2))
    if interpret and tiles == 1:  # the tile loop's index then constant-folds into an
        # integer remainder by zero (jax's planar_snake): SIGFPE kills the process
        raise ValueError("interpret mode needs two or more output tiles")
    params = None if interpret else plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    return plgpu.kernel(
        functools.partial(hm.kernel, config=config),
        out_type=jax.ShapeDtypeStruct((m, n), a.dtype),
        grid=(max(1, min(num_programs, tiles)),), grid_names=("cluster_grid",),
        cluster=(1,), cluster_names=("cluster",), num_threads=3, thread_name="wg",
        kernel_name="matmul_mgpu", compiler_params=params, interpret=interpret_params() if interpret else None,
    )(a, b, None)


def matmul_reference(a, b):
    """The same product in f32."""
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
