"""The host loop before and after, on one machine, interleaved (issue 43 item 1): runs
`nanojax.bench.host` at each running count in this tree and in another one (a `git
archive` of an older commit, with nanojax/engine/mock_forward.py and nanojax/bench/host.py
copied in), alternating, each in its own process. KEY=VALUE arguments set other
HostBenchConfig fields (JSON values: structured_fraction=1 async_dispatch=true).
Usage: python bench/repro/engine_host/host_ab.py BASE_DIR OUT.json [RUNNING,...] [REPEATS]
       [KEY=VALUE ...]"""
import json
import os
import subprocess
import sys

CODE = ("import json, sys; from nanojax.bench.host import HostBenchConfig, run_host_bench; "
        "print(json.dumps(run_host_bench(HostBenchConfig(running=int(sys.argv[1]), "
        "**json.loads(sys.argv[2])))))")


def run(tree: str, running: int, overrides: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run([sys.executable, "-c", CODE, str(running), json.dumps(overrides)],
                         cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(base: str, path: str, running: str = "1000,2000,4000", repeats: str = "2",
         *settings: str):
    overrides = {k: json.loads(v) for k, v in (a.split("=", 1) for a in settings)}
    rows = []
    for n in map(int, running.split(",")):
        for rep in range(int(repeats)):
            for name, tree in (("base", base), ("new", ".")):
                r = run(tree, n, overrides)
                rows.append({"tree": name, "running": n, "repeat": rep, **r})
                print(f"{name} running {n}: host {r['host_ms_per_iteration']:.2f} ms/iteration",
                      file=sys.stderr)
    summary = {}
    for n in sorted({r["running"] for r in rows}):
        best = {t: min(r["host_ms_per_iteration"] for r in rows
                       if r["running"] == n and r["tree"] == t) for t in ("base", "new")}
        summary[n] = {**best, "new_over_base": best["new"] / best["base"]}
    from nanojax.profiling.record import run_record  # command, environment, XLA flags
    with open(path, "w") as f:
        json.dump({**run_record(None), "argv": sys.argv, "overrides": overrides, "rows": rows,
                   "summary": summary},
                  f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main(*sys.argv[1:])
