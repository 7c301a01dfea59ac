"""Where the engine's host thread is while the device idles between steps.

Reads the raw profiler trace an engine timeline keeps (`nanojax bench --timeline X.json`
writes X.trace.json.gz): the device's kernels, and on the host the engine's phases
(TraceAnnotations nanojax.schedule / launch / inputs / dispatch_forward / dispatch_sample /
process / to_host) and XLA's own host events (waits on buffer holds, transfers), on one
clock. For every device step (a run of kernels; a gap over --gap-ms ends it) it lists each
host phase's start and end relative to that step's end, and sums each host event's time
per step. Usage: python bench/scripts/engine_host_timeline.py X.trace.json.gz [--json OUT]
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
    device, host = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        item = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        if e["pid"] in gpu:
            if "Memcpy" not in e["name"]:
                device.append(item)
        elif not e["name"].startswith("$"):
            host.append(item)
    return sorted(device), sorted(host)


def steps(device, gap_us: float):
    out, start, end = [], None, None
    for a, b, _ in device:
        if start is None:
            start, end = a, b
        elif a > end + gap_us:
            out.append((start, end))
            start, end = a, b
        else:
            end = max(end, b)
    if start is not None:
        out.append((start, end))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--gap-ms", type=float, default=1.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    device, host = load(args.trace)
    runs = steps(device, 1e3 * args.gap_ms)
    report = {"trace": args.trace, "steps": []}
    for i, (a, b) in enumerate(runs):
        nxt = runs[i + 1][0] if i + 1 < len(runs) else None
        row = {"step_ms": (b - a) / 1e3,
               "idle_after_ms": None if nxt is None else (nxt - b) / 1e3}
        # host events from this step's start to the next one's: relative to this step's end
        hi = nxt if nxt is not None else b + 50e3
        phases = collections.defaultdict(list)
        totals = collections.Counter()
        for s, e, name in host:
            if a <= s < hi:
                totals[name] += (e - s) / 1e3
                if name.startswith("nanojax.") or name.startswith("Wait"):
                    phases[name].append((round((s - b) / 1e3, 2), round((e - b) / 1e3, 2)))
        row["phases_vs_step_end_ms"] = dict(phases)
        row["host_ms"] = {k: round(v, 3) for k, v in totals.most_common(25)}
        report["steps"].append(row)
        print(f"step {i}: {row['step_ms']:.1f} ms, idle after "
              f"{row['idle_after_ms'] if nxt else float('nan'):.2f} ms")
        for k, v in phases.items():
            print(f"   {k:28s} {v[:4]}")
        print("   host totals:", {k: round(v, 2) for k, v in totals.most_common(8)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
