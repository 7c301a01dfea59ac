"""What the kernels ask of the device they run on: its SM count, a persistent grid's size."""
from __future__ import annotations

import jax

# the SM count assumed where the device does not say (a CPU device, interpret mode): the
# H200's, the GPU the kernels' grids were tuned on, so a grid worked out off the GPU
# matches the one it was tuned as
FALLBACK_SMS = 132


def device_sms(device=None) -> int:
    """The SM count of `device` (None: jax's first device): a GPU device's core_count;
    FALLBACK_SMS where the device reports none (jax's CPU devices have no core_count)."""
    device = jax.devices()[0] if device is None else device
    sms = getattr(device, "core_count", None)
    return int(sms) if sms else FALLBACK_SMS
