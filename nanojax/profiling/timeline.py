"""Timeline of one iteration per stream, from a jax profiler trace: which kernel ran on
which stream when, how much of the iteration the GPU spent in GEMMs (compute-bound) and in
attention (memory-bound), and how much of the attention overlapped a GEMM: on another
stream, or inside a fused GEMM + attention launch (kind "pair": the two on disjoint SMs, so
counted as both). Rendered as a Gantt chart with busy-fraction curves, like NanoFlow's
Figure 10.
"""
from __future__ import annotations

import glob
import gzip
import json
import re
import shutil
import tempfile
from pathlib import Path

import jax

KINDS = ("gemm", "attention", "pair", "collective", "other")
_PATTERNS = {
    # the overlap pair in one launch (pallas_kernels/fused_gemm_attention_mgpu.py); its GEMM
    # body alone is "fused_pair_gemm", a GEMM
    "pair": re.compile(r"^fused_gemm_attention", re.I),
    # Pallas kernels carry a name: a Triton-lowered one its call's, a Mosaic GPU one its
    # kernel_name (or body function's) + "_mosaic_gpu_kernel". pallas_kernels/ names
    # theirs (decode_attention_swapab, fused_gemm_attention, matmul_mgpu, ...); events saved
    # before that call the swap-AB kernel "_lambda_" and the first Mosaic one "kernel".
    "attention": re.compile(r"attention|pallas|^_lambda__mosaic_gpu|^kernel_mosaic_gpu", re.I),
    "collective": re.compile(r"nccl|all-reduce|all-gather|reduce-scatter", re.I),
    # any other Mosaic GPU kernel is a GEMM: jax's grouped GEMM (the MoE experts) is "body"
    "gemm": re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|^dot|triton_gemm|mosaic_gpu",
                       re.I),
}


def classify(name: str, hlo_op: str = "") -> str:
    for kind in ("pair", "attention", "collective", "gemm"):
        if _PATTERNS[kind].search(name) or _PATTERNS[kind].search(hlo_op):
            return kind
    return "other"


def parse_trace(path: str) -> list[dict]:
    """Device kernel events of a trace.json.gz: stream, name, kind, start and duration (us).
    On a GPU the device's streams; without one, the host's XLA ops (CPU tests)."""
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, n in procs.items() if n.startswith("/device:GPU")}
    if len(gpu) > 1:  # tensor parallelism: every GPU runs the same program; keep the first
        gpu = {min(gpu, key=lambda p: procs[p])}
    out = []
    for e in events:
        if e.get("ph") != "X" or (gpu and e["pid"] not in gpu):
            continue
        hlo_op = e.get("args", {}).get("hlo_op", "")
        if not gpu and not hlo_op:
            continue
        out.append({"stream": threads.get((e["pid"], e["tid"]), str(e["tid"])),
                    "name": e["name"][:120], "hlo_op": hlo_op,
                    "kind": classify(e["name"], hlo_op),
                    "start_us": float(e["ts"]), "dur_us": float(e["dur"])})
    if out:
        t0 = min(e["start_us"] for e in out)
        for e in out:
            e["start_us"] -= t0
    return sorted(out, key=lambda e: e["start_us"])


def reclassify(timelines: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """A saved events file read with today's kernel patterns (kinds come from the names)."""
    return {mode: [dict(e, kind=classify(e["name"], e.get("hlo_op", ""))) for e in ev]
            for mode, ev in timelines.items()}


def capture(fn, log_dir: str | None = None, keep_trace: str | None = None) -> list[dict]:
    """Runs fn() (which must block on its result) under the profiler; its kernel events.
    keep_trace: a path to copy the raw trace.json.gz to (host threads included: the
    engine's phases are TraceAnnotations, on the device events' clock)."""
    return parse_trace(capture_raw(fn, log_dir, keep_trace))


def capture_raw(fn, log_dir: str | None = None, keep_trace: str | None = None) -> str:
    """capture() without parsing: the raw trace's path, to parse_trace later (a running
    engine's profile: the parse would stall the loop it measures)."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="nanojax-trace-")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # a traced Python call costs the host several times it
    jax.profiler.start_trace(log_dir, profiler_options=options)
    try:
        fn()
    finally:
        jax.profiler.stop_trace()
    newest = max(glob.glob(f"{log_dir}/plugins/profile/*/*.trace.json.gz"),
                 key=lambda p: Path(p).stat().st_mtime)
    if keep_trace:  # (its folder made, as write_json makes the result's)
        Path(keep_trace).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(newest, keep_trace)
    return newest


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _length(intervals):
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys):
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: list[dict]) -> dict:
    """Busy fraction of the iteration per kind (time any kernel of that kind ran), kernel
    time per kind, the share of attention time that ran while a GEMM ran on another stream
    (attention_overlapped_by_gemm), and the share of attention-carrying time (attention
    kernels and fused pairs) spent in fused GEMM + attention launches
    (attention_in_fused_pair)."""
    if not events:
        return {"span_us": 0.0}
    span = max(e["start_us"] + e["dur_us"] for e in events)
    by_kind = {k: _union([(e["start_us"], e["start_us"] + e["dur_us"])
                          for e in events if e["kind"] == k]) for k in KINDS}
    attn = _length(by_kind["attention"])
    pair = _length(by_kind["pair"])
    coll = _length(by_kind["collective"])
    return {
        "collective_us": coll,
        "collective_overlapped_by_gemm": (_intersect(by_kind["collective"], by_kind["gemm"])
                                          / coll if coll else 0.0),
        "span_us": span,
        "streams": sorted({e["stream"] for e in events}),
        "kernel_us": {k: sum(e["dur_us"] for e in events if e["kind"] == k) for k in KINDS},
        "busy_fraction": {k: _length(v) / span for k, v in by_kind.items()},
        # any kernel on any stream: below 1 the device sat idle (between engine steps:
        # the host's launch came late)
        "busy_fraction_any": _length(_union([(e["start_us"], e["start_us"] + e["dur_us"])
                                             for e in events])) / span,
        "attention_overlapped_by_gemm": (_intersect(by_kind["attention"], by_kind["gemm"])
                                         / attn if attn else 0.0),
        "attention_in_fused_pair": (pair / _length(_union(by_kind["pair"] + by_kind["attention"]))
                                    if pair else 0.0),
    }


_COLORS = {"gemm": "tab:blue", "attention": "tab:orange", "pair": "tab:purple",
           "collective": "tab:green", "other": "tab:gray"}


def plot(timelines: dict[str, list[dict]], png: str, title: str, bins: int = 400) -> None:
    """One Gantt panel per mode (rows: streams; colour: kind) over a shared time axis, each
    with the busy fraction of GEMM (compute) and attention (memory) kernels below it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = [m for m, ev in timelines.items() if ev]
    span = max(e["start_us"] + e["dur_us"] for m in modes for e in timelines[m]) / 1e3
    fig, axes = plt.subplots(2 * len(modes), 1, figsize=(14, 3.2 * len(modes)),
                             gridspec_kw={"height_ratios": [3, 1] * len(modes)})
    for i, mode in enumerate(modes):
        ev, ax, ux = timelines[mode], axes[2 * i], axes[2 * i + 1]
        streams = sorted({e["stream"] for e in ev})
        for e in ev:
            ax.barh(streams.index(e["stream"]), e["dur_us"] / 1e3, left=e["start_us"] / 1e3,
                    color=_COLORS[e["kind"]], height=0.8, linewidth=0)
        ax.set_yticks(range(len(streams)), [s[:28] for s in streams], fontsize=7)
        ax.set_xlim(0, span)
        s = summarize(ev)
        fused = (f", in fused GEMM + attention launches {100 * s['attention_in_fused_pair']:.0f}%"
                 if s["attention_in_fused_pair"] else "")
        ax.set_title(f"{mode}: {s['span_us'] / 1e3:.2f} ms; attention overlapped by GEMM "
                     f"{100 * s['attention_overlapped_by_gemm']:.0f}%{fused}", fontsize=9)
        edges = np.linspace(0, span, bins + 1)
        for kind, label in (("gemm", "GEMM busy (compute)"),
                            ("attention", "attention busy (memory)")):
            busy = np.zeros(bins)  # a fused pair keeps both busy
            for a, b in _union([(e["start_us"] / 1e3, (e["start_us"] + e["dur_us"]) / 1e3)
                                for e in ev if e["kind"] in (kind, "pair")]):
                busy += np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0, None)
            ux.plot(edges[:-1], busy / (span / bins), color=_COLORS[kind], label=label, lw=0.8)
        ux.set_xlim(0, span)
        ux.set_ylim(0, 1.05)
        ux.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, list(_COLORS), loc="upper right", fontsize=8, ncol=5)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
