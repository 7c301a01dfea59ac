"""A nanojax command's compile phases (issue 20 item 3), from jax's own monitoring events:
seconds spent tracing Python to jaxprs, lowering jaxprs to StableHLO, and in the backend
compile (a persistent-cache hit: the cache lookup and load), summed over every program.
Runs the command twice in one fresh compile-cache directory, each in its own process.

    python bench/scripts/start_phases.py OUT.json -- generate Hello --max-tokens 16
"""
import json
import os
import subprocess
import sys
import tempfile
import time

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_or_load_s"}


def child(out: str, argv: list) -> None:
    import jax
    from nanojax.cli import main
    sums = {v: 0.0 for v in EVENTS.values()}
    counts = {v: 0 for v in EVENTS.values()}

    def listen(event, secs, **_):
        if event in EVENTS:
            sums[EVENTS[event]] += secs
            counts[EVENTS[event]] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    t0 = time.monotonic()
    rc = main(argv)
    wall = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump({"rc": rc, "wall_s": round(wall, 3),
                   **{k: round(v, 3) for k, v in sums.items()},
                   "programs": counts}, f)


def main():
    if sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[4:])
    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    runs = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as tmp:
        for i in range(2):
            part = os.path.join(tmp, f"run{i}.json")
            subprocess.run([sys.executable, __file__, "--child", part, "--", *argv,
                            "--compile-cache-dir", cache], check=True,
                           stdout=subprocess.DEVNULL)
            with open(part) as f:
                runs.append(json.load(f))
    import platform
    with open(out, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv),
                   "measure": "jax monitoring durations summed over all programs, per run; "
                              "run 1 with a fresh persistent cache, run 2 with it warm",
                   "runs": runs, "host": platform.node(), "cpus": os.cpu_count(),
                   "load_average_at_end": list(os.getloadavg())}, f, indent=1)
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
