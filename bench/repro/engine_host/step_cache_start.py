"""Engine start with the step executable cache against jax's persistent cache alone, on the
CPU (issue 20 item 3): a serving start's engine (fixed shapes, every token bucket compiled
at warmup) with the GPU's straight-line forward (UnrolledForward, pure-JAX attention here),
each start in its own process, all sharing one fresh cache directory:

  1 jax_cold        --no-step-cache, empty cache: compiles (fills jax's cache)
  2 jax_warm        --no-step-cache: trace + lower + jax's cache load (today's warm start)
  3 step_cold       step cache on, no entries: traces, compiles afresh, stores
  4 step_warm       step cache on: loads the executables, traces nothing

    python bench/repro/engine_host/step_cache_start.py OUT.json --model smollm2-135m --b-dense 256
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def child(args) -> dict:
    import jax
    from nanojax import compile_cache
    compile_cache.enable(args.cache)
    from checkpoints.loader import load_model
    from nanojax.config import EngineConfig
    from nanojax.engine.forward import UnrolledForward
    from nanojax.engine.llm_engine import LLMEngine
    bundle = load_model(f"random:{args.model}", dtype="float32")
    phases = {"trace_s": 0.0, "lower_s": 0.0, "compile_or_load_s": 0.0}
    events = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "compile_or_load_s"}

    def listen(event, secs, **_):  # jax's own timings, every program of the start
        if event in events:
            phases[events[event]] += secs

    jax.monitoring.register_event_duration_secs_listener(listen)
    t0 = time.monotonic()
    eng = LLMEngine(bundle, EngineConfig(b_dense=args.b_dense, num_pages=256,
                                         max_model_len=2048, max_num_seqs=8,
                                         fixed_shapes=True, step_cache=args.step_cache),
                    forward=UnrolledForward(bundle.config))
    t1 = time.monotonic()
    traced = eng.runner.warmup()
    t2 = time.monotonic()
    return {"engine_s": round(t1 - t0, 3), "warmup_s": round(t2 - t1, 3),
            "shapes_traced": traced, "shapes_loaded": eng.runner.num_loaded,
            **{k: round(v, 3) for k, v in phases.items()},
            "jax": jax.__version__}


def starts_in_one_cache(argv: list[str], starts) -> dict:
    """Runs `python argv --child --cache DIR [--step-cache]` once per (name, step_cache) of
    starts, in order, each its own process, all over one fresh cache directory; returns
    name -> the JSON line each child printed last."""
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        for name, step in starts:
            cmd = [sys.executable, *argv, "--child", "--cache", cache]
            out = subprocess.run(cmd + (["--step-cache"] if step else []), check=True,
                                 capture_output=True, text=True).stdout
            runs[name] = json.loads(out.strip().splitlines()[-1])
            print(name, runs[name], file=sys.stderr, flush=True)
    return runs


def start_parser() -> argparse.ArgumentParser:
    """The arguments of a start script: its own, and a child start's (--child ...)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--b-dense", type=int, default=256)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--cache")
    ap.add_argument("--step-cache", action="store_true")
    return ap


def main():
    args = start_parser().parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = starts_in_one_cache(
        [__file__, args.out, "--model", args.model, "--b-dense", str(args.b_dense)],
        (("jax_cold", False), ("jax_warm", False), ("step_cold", True), ("step_warm", True)))
    with open(args.out, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv),
                   "measure": "engine construction and warmup (every step shape) per start, "
                              "each start a fresh process; one shared cache directory; "
                              "trace/lower/compile_or_load: jax's monitoring durations "
                              "summed over the start's programs (step cache loads are "
                              "in none of them)",
                   "model": f"random:{args.model}", "b_dense": args.b_dense,
                   "forward": "UnrolledForward", "runs": runs, "host": platform.node(),
                   "cpus": os.cpu_count(), "load_average_at_end": list(os.getloadavg())},
                  f, indent=1)


if __name__ == "__main__":
    main()
