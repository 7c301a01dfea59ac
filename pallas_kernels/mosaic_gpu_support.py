"""What the Mosaic GPU kernels share: where they can run, and their CPU interpreter."""
from __future__ import annotations

import jax


def on_hopper() -> bool:
    """Is the default device a Hopper (sm_90) or newer NVIDIA GPU? Mosaic GPU needs one."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and float(getattr(dev, "compute_capability", 0)) >= 9.0


def fp8_dtype_misfit(x8, w8, out_dtype) -> str | None:
    """What the FP8 WGMMA kernels refuse in their operands' and output's dtypes: two e4m3
    operands, a 16-bit output (None: nothing)."""
    import jax.numpy as jnp
    if x8.dtype != jnp.float8_e4m3fn or w8.dtype != jnp.float8_e4m3fn:
        return f"needs two float8_e4m3fn operands, got {x8.dtype} and {w8.dtype}"
    if jnp.dtype(out_dtype).itemsize != 2:
        return f"writes a 16-bit output, not {jnp.dtype(out_dtype)}"
    return None


def interpret_params():
    """Mosaic GPU's CPU interpreter (a public name in newer jax, private in 0.10)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if hasattr(plgpu, "InterpretParams"):
        return plgpu.InterpretParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def copy_pages_to_slot(k_ref, v_ref, k_slot, v_slot, pages, kv_head: int, kvh: int,
                       page_size: int, k_bar, v_bar):
    """TMA copies of one block of paged keys and values into a ring slot: one copy per
    (page, kv head) tile of the [N * KVH, ps, D] views, all arriving on the slot's two
    barriers (each expects len(pages) arrivals)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    for p, page in enumerate(pages):
        row = page * kvh + kv_head
        dst = pl.ds(p * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_ref.at[row], k_slot.at[dst], k_bar)
        plgpu.copy_gmem_to_smem(v_ref.at[row], v_slot.at[dst], v_bar)
