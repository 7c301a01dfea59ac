"""What every result file records: the command, the software and device it ran on, the
XLA flags in force and the full configuration, so that two results can be told apart."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from pathlib import Path


def environment() -> dict:
    import jax
    from nanojax.engine.kv_cache import MEM_FRACTION_ENV
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)), "num_devices": jax.device_count(),
            "python": platform.python_version(), "host": platform.node(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            # the allocator's share of the card (--gpu-memory-utilization; unset: jax's 0.75)
            "mem_fraction": next((os.environ[e] for e in MEM_FRACTION_ENV
                                  if os.environ.get(e)), None),
            "memory_limit_bytes": _memory_limit(dev)}


def _memory_limit(dev) -> int | None:
    try:
        return (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # (CPU devices may not say)
        return None


def run_record(config=None, model_config=None) -> dict:
    """command + environment (+ the config dataclass, as a dict, and the model's config:
    its shape, dtype and quantization) of this process."""
    rec = {"command": " ".join(["nanojax"] + sys.argv[1:]), "env": environment()}
    if config is not None:
        rec["config"] = dataclasses.asdict(config)
    if model_config is not None:
        rec["model_config"] = model_config.to_dict()
    return rec


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"nanojax: wrote {path}", file=sys.stderr)
