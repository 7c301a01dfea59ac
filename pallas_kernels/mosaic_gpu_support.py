"""What the Mosaic GPU kernels share: where they can run, and their CPU interpreter."""
from __future__ import annotations

import jax


def on_hopper() -> bool:
    """Is the default device a Hopper (sm_90) or newer NVIDIA GPU? Mosaic GPU needs one."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and float(getattr(dev, "compute_capability", 0)) >= 9.0


def interpret_params():
    """Mosaic GPU's CPU interpreter (a public name in newer jax, private in 0.10)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if hasattr(plgpu, "InterpretParams"):
        return plgpu.InterpretParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
