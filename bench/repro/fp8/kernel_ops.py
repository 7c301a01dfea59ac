"""Device time per XLA op family in a timeline's events (`nanojax bench throughput --timeline
X.events.json`: the engine's; `nanojax bench step --timeline X.png` writes X.events.json with
one iteration per mode: --mode): what an iteration's kernels are, beyond the timeline's
gemm / attention / other split. The family is the HLO op's name without its number (cublas-gemm,
gemm_fusion_dot_general, loop_convert_fusion, ...), or the kernel's where XLA names none.

Usage: python bench/repro/fp8/kernel_ops.py X.events.json [--iterations 6] [--mode M] [--json OUT]
"""
import argparse
import collections
import json


def breakdown(path: str, iterations: int, mode: str = "engine") -> dict:
    timelines = json.load(open(path))
    if mode not in timelines:
        raise SystemExit(f"{path} has no {mode!r} timeline; it has {sorted(timelines)}")
    events = timelines[mode]
    ms, calls, kind = collections.Counter(), collections.Counter(), {}
    for e in events:
        if "Compute" not in e["stream"]:  # copies have their own streams
            continue
        family = e["hlo_op"].split(".")[0] or e["name"][:60]
        ms[family] += e["dur_us"] / 1e3 / iterations
        calls[family] += 1 / iterations
        kind[family] = e["kind"]
    return {"profile": path, "mode": mode, "iterations": iterations,
            "kernel_ms_per_iteration": round(sum(ms.values()), 3),
            "by_kind_ms": {k: round(sum(v for f, v in ms.items() if kind[f] == k), 3)
                           for k in sorted(set(kind.values()))},
            "ops": [{"op": f, "kind": kind[f], "ms_per_iteration": round(v, 3),
                     "calls_per_iteration": round(calls[f], 1)}
                    for f, v in ms.most_common() if v >= 0.005]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("events")
    ap.add_argument("--iterations", type=int, default=6, help="iterations the profile holds")
    ap.add_argument("--mode", default="engine",
                    help="the timeline to read (a step's events hold one per mode)")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = breakdown(a.events, a.iterations, a.mode)
    for op in out["ops"]:
        print(f"{op['ms_per_iteration']:7.2f} ms  x{op['calls_per_iteration']:6.1f}  "
              f"{op['kind']:9s} {op['op']}")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
