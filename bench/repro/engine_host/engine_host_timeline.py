"""Where the engine's host thread is while the device idles between steps.

Reads the raw profiler trace an engine timeline keeps (`nanojax bench --timeline X.json`
writes X.trace.json.gz): the device's kernels, and on the host the engine's phases
(TraceAnnotations nanojax.schedule / launch / inputs / dispatch_forward / dispatch_sample /
process / to_host) and XLA's own host events (waits on buffer holds, transfers), on one
clock. Each device step starts with a burst of host-to-device input copies (a pause over
--gap-ms between copies starts a new burst); for every step it gives its kernels' span,
the device's idle time before its first kernel, each host phase's start and end relative
to the step's end, and each host event's time summed over the step. Usage: python bench/repro/engine_host/engine_host_timeline.py X.trace.json.gz [--json OUT]
"""
import argparse
import collections
import gzip
import json


def load(path: str):
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in procs.items() if n.startswith("/device:GPU")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device, copies, host = [], [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        item = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        stream = threads.get((e["pid"], e["tid"]), "")
        if e["pid"] in gpu:
            if "MemcpyH2D" in stream or e["name"] == "MemcpyH2D":
                copies.append(item)
            elif "Memcpy" not in stream and "Memcpy" not in e["name"]:
                device.append(item)
        elif not e["name"].startswith("$"):
            host.append(item)
    return sorted(device), sorted(copies), sorted(host)


def steps(device, copies, gap_us: float):
    """(first kernel, last kernel end, first copy) per step: steps begin at copy bursts."""
    starts = [a for i, (a, _, _) in enumerate(copies)
              if i == 0 or a > copies[i - 1][1] + gap_us]
    out = []
    for i, c in enumerate(starts):
        hi = starts[i + 1] if i + 1 < len(starts) else float("inf")
        ks = [(a, b) for a, b, _ in device if c <= a < hi]
        if ks:
            out.append((ks[0][0], max(b for _, b in ks), c))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--gap-ms", type=float, default=1.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    device, copies, host = load(args.trace)
    runs = steps(device, copies, 1e3 * args.gap_ms)
    report = {"trace": args.trace, "steps": []}
    for i, (a, b, c) in enumerate(runs):
        prev_end = runs[i - 1][1] if i else None
        row = {"kernels_ms": (b - a) / 1e3,
               "idle_before_ms": None if prev_end is None else (a - prev_end) / 1e3,
               "copies_after_previous_end_ms": None if prev_end is None else
               (c - prev_end) / 1e3}
        hi = runs[i + 1][0] if i + 1 < len(runs) else b
        phases = collections.defaultdict(list)
        totals = collections.Counter()
        for s, e, name in host:
            if a <= s < hi:
                totals[name] += (e - s) / 1e3
                if name.startswith("nanojax."):
                    phases[name].append((round((s - b) / 1e3, 2), round((e - b) / 1e3, 2)))
        row["phases_vs_step_end_ms"] = dict(phases)
        row["host_ms"] = {k: round(v, 3) for k, v in totals.most_common(25)}
        report["steps"].append(row)
        print(f"step {i}: kernels {row['kernels_ms']:.1f} ms, idle before "
              f"{row['idle_before_ms']}, copies after previous end "
              f"{row['copies_after_previous_end_ms']}")
        for k, v in phases.items():
            print(f"   {k:28s} {v[:4]}")
        print("   host totals:", {k: round(v, 2) for k, v in totals.most_common(8)})
    idle = [r["idle_before_ms"] for r in report["steps"] if r["idle_before_ms"] is not None]
    report["mean_idle_between_steps_ms"] = sum(idle) / len(idle) if idle else None
    report["mean_step_period_ms"] = ((runs[-1][1] - runs[0][1]) / 1e3 / (len(runs) - 1)
                                     if len(runs) > 1 else None)
    print("mean idle between steps", report["mean_idle_between_steps_ms"], "ms; period",
          report["mean_step_period_ms"], "ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
