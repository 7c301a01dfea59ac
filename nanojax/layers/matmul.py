"""GEMMs at a resource share: NanoFlow's R for the compute half of an overlapped pair.

XLA's GEMMs (cuBLAS) launch on every SM, so beside a decode attention bounded to part of
the GPU the two streams' kernels mostly take turns. A GEMM nano-op whose plan share is
below 1 can instead run on that share of the SMs (pallas_kernels/matmul_mgpu.py, Hopper),
leaving the rest to the attention. At share 1, off Hopper, and for operands the kernel
cannot tile, a GEMM is XLA's dot. Opt-in (KernelConfig.gemm_shares) until a bounded pair
is measured to beat the two kernels back to back (bench/repro/overlap_search/bounded_overlap_probe.py).
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp


def matmul_at(share: float, num_sms: int, enabled: bool = False,
              interpret: bool = False) -> Callable | None:
    """A matmul(x, w) limited to share x num_sms programs (num_sms: the device's SMs,
    pallas_kernels/device.py), or None for the layers' own dot (share 1, not enabled, or
    no Hopper GPU; interpret runs the kernel on the CPU)."""
    if share >= 1.0 or not enabled:
        return None
    from pallas_kernels.mosaic_gpu_support import on_hopper
    if not interpret and not on_hopper():
        return None
    programs = max(1, round(share * num_sms))

    def matmul(x, w):
        from pallas_kernels.matmul_mgpu import matmul_mgpu, unsupported
        if unsupported(x, w) is not None:  # e.g. a nano-batch not a multiple of 128 rows
            return jnp.dot(x, w)
        return matmul_mgpu(x, w, num_programs=programs, interpret=interpret)
    return matmul
