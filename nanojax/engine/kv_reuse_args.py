"""Command-line flags for KV reuse (prefix caching, offload tiers), shared by generate,
serve and bench. Names follow vLLM (`--enable-prefix-caching`, on by default there too);
the offload limits are byte counts (suffixes K, M, G, T, powers of 1024), in the spirit
of vLLM's `--kv-offloading-size` and LMCache's local CPU / disk sizes."""
from __future__ import annotations

import argparse

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(s: str) -> int:
    t = s.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        v = float(t[:-1] if unit else t) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {s!r} (e.g. 4096, 512M, 64G)")
    if v < 0:
        raise argparse.ArgumentTypeError(f"a byte count must be >= 0, got {s}")
    return int(v)


def add_kv_reuse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share the KV pages of common prompt prefixes "
                                      "(automatic prefix caching)")
    p.add_argument("--kv-offload-host-bytes", type=parse_bytes, default=0,
                   help="copy finished requests' KV pages to this much host memory and load "
                        "them back for a returning prefix (0: off)")
    p.add_argument("--kv-offload-dir", default=None,
                   help="also keep them in this directory (per model fingerprint), reused "
                        "after a restart")
    p.add_argument("--kv-offload-disk-bytes", type=parse_bytes, default=16 << 30,
                   help="the disk tier's limit (default 16G)")


def kv_reuse_config(args) -> dict:
    """EngineConfig fields from the flags."""
    return {"enable_prefix_caching": args.enable_prefix_caching,
            "kv_offload_host_bytes": args.kv_offload_host_bytes,
            "kv_offload_dir": args.kv_offload_dir,
            "kv_offload_disk_bytes": args.kv_offload_disk_bytes}
