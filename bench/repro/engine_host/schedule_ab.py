"""The scheduler before and after (issue 43: the schedule phase), in ONE process,
interleaved: `nanojax.bench.host` (the engine around the stand-in model) at each running
count, alternating the base scheduler (nanojax/engine/scheduler.py at BASE_REV, loaded
beside this tree's) and this tree's, everything else this tree's. The base takes the rows
of the step in flight as a dict, as the engine built it before (inside the schedule
phase's time, where the engine built it). Per run: the steady window's medians per
iteration of host and schedule ms (and means); per variant: the median over the runs; and
the median over the repeats of new / base within a repeat (the two runs side by side).
Usage: python bench/repro/engine_host/schedule_ab.py OUT.json [RUNNING,...] [REPEATS]
       [BASE_REV]"""
import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from unittest import mock


def base_scheduler(rev: str):
    """The Scheduler class of nanojax/engine/scheduler.py at rev, as a module of its own,
    with the engine's old call: schedule(prev_rows) took {id(seq): row} of the step in
    flight."""
    src = subprocess.run(["git", "show", f"{rev}:nanojax/engine/scheduler.py"],
                         capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("base_scheduler", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["base_scheduler"] = mod  # (dataclasses look their module up)
    exec(compile(src, f"{rev}:nanojax/engine/scheduler.py", "exec"), mod.__dict__)

    class Base(mod.Scheduler):
        def schedule(self, prev=None):
            rows = {id(e.seq): r for r, e in enumerate(prev.entries)} if prev else {}
            return super().schedule(rows)
    return Base


def one_run(running: int, scheduler_cls) -> dict:
    """run_host_bench with the engine's Scheduler replaced (None: this tree's); the
    steady window's per-iteration medians taken from its trace."""
    from nanojax.bench import host
    from nanojax.engine import llm_engine
    captured = {}
    steady = host.steady_state

    def keep(trace, b_dense, mean_stay):
        out = steady(trace, b_dense, mean_stay)
        captured["trace"], captured["window"] = trace, out.get("window")
        return out
    patches = [mock.patch.object(host, "steady_state", keep)]
    if scheduler_cls is not None:
        patches.append(mock.patch.object(llm_engine, "Scheduler", scheduler_cls))
    for p in patches:
        p.start()
    try:
        r = host.run_host_bench(host.HostBenchConfig(running=running))
    finally:
        for p in patches:
            p.stop()
    first, last = captured["window"]
    win = captured["trace"][first:last + 1]
    med = {k: 1e3 * statistics.median(getattr(x, k + "_s") for x in win)
           for k in ("host", "schedule", "launch", "process")}
    return {"host_ms_median": med["host"], "schedule_ms_median": med["schedule"],
            "launch_ms_median": med["launch"], "process_ms_median": med["process"],
            **{k: r[k] for k in ("host_ms_per_iteration", "schedule_ms_per_iteration",
                                 "launch_ms_per_iteration", "process_ms_per_iteration",
                                 "mean_running", "mean_fill", "window_iterations",
                                 "iterations")}}


def main(path: str, running: str = "1000,2000", repeats: str = "5", rev: str = "HEAD"):
    from nanojax.bench.host import HostBenchConfig
    from nanojax.profiling.record import run_record
    variants = {"base": base_scheduler(rev), "new": None}
    rows = []
    for n in map(int, running.split(",")):
        for rep in range(int(repeats)):
            order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
            for name in order:
                t = time.perf_counter()
                r = one_run(n, variants[name])
                rows.append({"variant": name, "running": n, "repeat": rep,
                             "wall_s": time.perf_counter() - t, **r})
                print(f"{name} running {n}: host {r['host_ms_median']:.2f} ms, schedule "
                      f"{r['schedule_ms_median']:.2f} ms (medians per iteration)",
                      file=sys.stderr)
    summary = {}
    for n in sorted({r["running"] for r in rows}):
        med = {v: {k: statistics.median(r[k] for r in rows
                                        if r["running"] == n and r["variant"] == v)
                   for k in ("host_ms_median", "schedule_ms_median", "launch_ms_median",
                             "process_ms_median", "host_ms_per_iteration",
                             "schedule_ms_per_iteration")}
               for v in variants}
        ratios = ("host_ms_median", "schedule_ms_median", "host_ms_per_iteration",
                  "schedule_ms_per_iteration")
        pairs = [{r["variant"]: r for r in rows if r["running"] == n and r["repeat"] == rep}
                 for rep in range(int(repeats))]
        summary[n] = {**med, "new_over_base": {k: med["new"][k] / med["base"][k] for k in ratios},
                      # each repeat's new over its base (run next to it): robust to a load
                      # that drifts over the whole measurement
                      "paired_new_over_base_median": {k: statistics.median(
                          p["new"][k] / p["base"][k] for p in pairs) for k in ratios}}
    rec = run_record(None)
    rec["command"] = " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv)
    payload = {**rec, "base": f"nanojax/engine/scheduler.py at {rev} "
               f"({subprocess.run(['git', 'rev-parse', rev], capture_output=True, text=True).stdout.strip()})",
               "new": "this tree's nanojax/engine/scheduler.py",
               "config": {"host_bench": {k: v for k, v in dataclasses.asdict(HostBenchConfig()).items()
                                         if k != "running"},
                          "running": [int(x) for x in running.split(",")],
                          "repeats": int(repeats), "interleaved": "base/new, order "
                          "alternating by repeat, one process"},
               "summary": summary, "runs": rows}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
