"""What the overlap-pair measurements share, so they run the same shapes and one plot reads
both: their shape flags, the JSON record (header, per-GEMM entry, one row per GEMM share
G), and the nvidia-smi SM clock / power sampler. nanojax/profiling/fused_pair.py times
nanojax's fused launch (for bench/kernels/fused_pair.py and `nanojax profile
--pair-shares`); bench/kernels/green_context_pair.py times PyTorch's cuBLAS + SDPA on CUDA
green contexts; search/pair.py reads the record.

Record: {"impl", "command", "device", "programs", "tokens", "batch", "ctx", "heads",
"head_dim", ..., "attention_full": case, "gemms": {name: entry}}; an entry is {"k", "n",
full-grid cases, "back_to_back": case, "shares": [row, ...], "best_G"} or {"error"}; a row
is {"G", "gemm_sms", "attention_sms", "gemm", "attention", "pair",
"back_to_back_over_pair", "pair_over_slower_part"} or {"G", "error"}; a case is {"case",
"ms", "power": PowerSampler.stop()'s summary or None}.

Standard library only: the PyTorch bench imports it on a box without jax (nanojax's
package imports no jax until asked).
"""
from __future__ import annotations

import subprocess
import threading
import time

# LLaMA-3-8B's GEMMs of one nano-batch: (K, N)
GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
         "down": (14336, 4096)}
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def make_parser(doc: str):
    """A bench's parser: its docstring's first paragraph, then the shared flags."""
    import argparse
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return p


def add_args(p):
    """The flags both benches take (same names, same defaults: same shapes)."""
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--gemms", default=",".join(GEMMS),
                   help=f"comma-separated subset of {', '.join(GEMMS)}")
    p.add_argument("--shares", default="44,66,88,110",
                   help="GEMM SMs G of the pair (attention gets the rest), comma-separated")
    p.add_argument("--tokens", type=int, default=1024, help="GEMM rows (nano-batch tokens)")
    p.add_argument("--batch", type=int, default=512, help="decode sequences")
    p.add_argument("--ctx", type=int, default=1024, help="keys per decode sequence")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--power-seconds", type=float, default=2.0,
                   help="how long each case runs while clock and power are sampled (0: off)")
    p.add_argument("--sample-ms", type=int, default=50)
    p.add_argument("--gpu-index", type=int, default=0, help="nvidia-smi's index of the GPU")


def check_args(p, args):
    """args with .gemms and .shares as lists; p.error names a bad value."""
    args.gemms = args.gemms.split(",")
    bad = [g for g in args.gemms if g not in GEMMS]
    if bad:
        p.error(f"--gemms: unknown {bad}; choose from {list(GEMMS)}")
    try:
        args.shares = [int(s) for s in args.shares.split(",")]
    except ValueError:
        p.error(f"--shares: expected comma-separated integers, got {args.shares!r}")
    if any(s <= 0 for s in args.shares):
        p.error(f"--shares: every G must be positive, got {args.shares}")
    return args


def header(impl: str, command: str, device: str, programs: int, args, **extra) -> dict:
    """args: the shapes (tokens, batch, ctx; heads [Q, KV] and head_dim when not the 8B's)
    and timing (iters, reps) measured."""
    return {"impl": impl, "command": command, "device": device, "programs": programs,
            "tokens": args.tokens, "batch": args.batch, "ctx": args.ctx,
            "heads": list(getattr(args, "heads", (Q_HEADS, KV_HEADS))),
            "head_dim": getattr(args, "head_dim", HEAD_DIM), "iters": args.iters,
            "reps": args.reps, **extra, "gemms": {}}


def case(name: str, ms: float, power: dict | None) -> dict:
    return {"case": name, "ms": ms, "power": power}


def gemm_entry(name: str, back_to_back: dict, shape=None, **full) -> dict:
    """A GEMM's entry before its shares: full-grid cases (back to back and the parts).
    shape: its (K, N) (None: the 8B's, GEMMS)."""
    k, n = shape or GEMMS[name]
    return {"k": k, "n": n, **full, "back_to_back": back_to_back, "shares": [],
            "best_G": None}


def share_row(g: int, gemm_sms: int, attention_sms: int, gemm: dict, attention: dict,
              pair: dict, back_to_back: dict, **extra) -> dict:
    """One share: the parts alone on their SMs, the pair, and its ratios."""
    return {"G": g, "gemm_sms": gemm_sms, "attention_sms": attention_sms, **extra,
            "gemm": gemm, "attention": attention, "pair": pair,
            "back_to_back_over_pair": back_to_back["ms"] / pair["ms"],
            "pair_over_slower_part": pair["ms"] / max(gemm["ms"], attention["ms"])}


def error_row(g: int, exc: BaseException) -> dict:
    return {"G": g, "error": repr(exc)[:400]}


def add_share(entry: dict, row: dict):
    """Append a row; best_G is the measured share with the largest gain (None: none)."""
    entry["shares"].append(row)
    ok = [r for r in entry["shares"] if "error" not in r]
    entry["best_G"] = max(ok, key=lambda r: r["back_to_back_over_pair"])["G"] if ok else None


class PowerSampler:
    """nvidia-smi's SM clock (MHz), board power (W) and active clock-event (throttle)
    reasons, one query every `ms` in a background thread between start() and stop();
    stop() summarises the samples taken after the first `settle_s` (power climbs for a few
    hundred ms after a case starts). None without nvidia-smi. One process per query, as
    ../shared/probes/overlap_power.py did on the H200 box."""

    FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"

    def __init__(self, gpu_index: int, ms: int, settle_s: float = 0.3):
        self.cmd = ["nvidia-smi", "-i", str(gpu_index), f"--query-gpu={self.FIELDS}",
                    "--format=csv,noheader,nounits"]
        self.ms, self.settle_s = ms, settle_s
        self.samples, self.thread, self.stopping = [], None, threading.Event()
        self.available = True

    def start(self):
        self.samples = []
        self.stopping.clear()
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stopping.is_set():
            t = time.perf_counter()
            try:
                out = subprocess.run(self.cmd, capture_output=True, text=True,
                                     timeout=5).stdout
            except (FileNotFoundError, PermissionError):
                self.available = False
                return
            except subprocess.TimeoutExpired:
                continue
            sample = parse_sample(out)
            if sample is not None:
                self.samples.append((time.perf_counter() - self.t0, *sample))
            self.stopping.wait(max(0.0, self.ms / 1e3 - (time.perf_counter() - t)))

    def stop(self) -> dict | None:
        self.stopping.set()
        self.thread.join(timeout=10)
        if not self.available:
            return None
        return summarise(self.samples, self.settle_s)


def parse_sample(line: str):
    """(clock MHz, power W, reasons hex or None) from one nvidia-smi csv line; None for
    "[N/A]" or a partial line."""
    parts = [x.strip() for x in line.strip().split(",")]
    try:
        clock, power = float(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        return None
    return clock, power, parts[2] if len(parts) > 2 else None


def summarise(samples, settle_s: float) -> dict:
    """samples: (seconds since start, clock, power, reasons)."""
    kept = [s for s in samples if s[0] >= settle_s]
    if not kept:
        return {"samples": 0, "settle_s": settle_s}
    _, clocks, powers, reasons = zip(*kept)
    return {"samples": len(kept), "settle_s": settle_s,
            "sm_clock_mhz_mean": sum(clocks) / len(clocks), "sm_clock_mhz_min": min(clocks),
            "power_w_mean": sum(powers) / len(powers), "power_w_max": max(powers),
            "throttle_reasons": sorted({r for r in reasons if r})}
