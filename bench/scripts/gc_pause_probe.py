"""How long Python's collections pause a nanojax command, with and without the start-up
objects frozen (nanojax/engine/gc_freeze.py). Runs `nanojax ARGS...` in this process under
a gc callback, after importing jax and nanojax; --freeze freezes what exists then (the
imports: what the engine loop's freeze keeps out of every later scan). Made for
`nanojax bench schedule` (the scheduler alone, no device): its loop allocates like the
engine's. Prints JSON: runs and pause per generation, the largest pause, the wall time.
Usage: python bench/scripts/gc_pause_probe.py [--freeze] -- bench schedule ...
"""
import gc
import json
import runpy
import sys
import time


def main():
    argv = sys.argv[1:]
    freeze = "--freeze" in argv[: argv.index("--")] if "--" in argv else "--freeze" in argv
    args = argv[argv.index("--") + 1:] if "--" in argv else [a for a in argv if a != "--freeze"]
    import jax  # noqa: F401 - the start-up objects a server or bench holds
    import nanojax.cli  # noqa: F401
    if freeze:
        gc.freeze()
    runs, pause, worst, t = [0, 0, 0], [0.0, 0.0, 0.0], [0.0], [0.0]

    def callback(phase, info):
        if phase == "start":
            t[0] = time.perf_counter()
            return
        d = time.perf_counter() - t[0]
        runs[info["generation"]] += 1
        pause[info["generation"]] += d
        worst[0] = max(worst[0], d)
    gc.callbacks.append(callback)
    sys.argv = ["nanojax", *args]
    t0 = time.perf_counter()
    try:
        runpy.run_module("nanojax", run_name="__main__")
    except SystemExit:
        pass
    wall = time.perf_counter() - t0
    gc.callbacks.remove(callback)
    print(json.dumps({"command": "python bench/scripts/gc_pause_probe.py "
                      + ("--freeze " if freeze else "") + "-- " + " ".join(args),
                      "freeze": freeze, "frozen_objects": gc.get_freeze_count(),
                      "runs_by_generation": runs,
                      "pause_ms_by_generation": [round(1e3 * p, 1) for p in pause],
                      "max_pause_ms": round(1e3 * worst[0], 1), "wall_s": round(wall, 2),
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
