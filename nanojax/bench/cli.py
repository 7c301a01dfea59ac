"""`nanojax bench [throughput] ...` (offline) and `nanojax bench serve ...` (online)."""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path


def environment() -> dict:
    import jax
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)), "num_devices": jax.device_count(),
            "python": platform.python_version(), "host": platform.node()}


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"nanojax: wrote {path}", file=sys.stderr)


def cmd_throughput(args) -> int:
    from checkpoints.loader import load_model
    from nanojax.bench.offline import run_offline
    from nanojax.bench.workload import make_requests
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine

    peer = None
    if args.peer:  # first, in its own process, before JAX holds the GPU's memory
        from nanojax.bench.peer import run_peer_subprocess
        if not args.model.startswith("random:"):
            raise SystemExit("nanojax: --peer needs --model random:<shape>")
        n = args.peer_num_prompts or args.num_prompts
        peer_args = ["--shape", args.model.split(":", 1)[1], "--num-prompts", str(n),
                     "--max-model-len", str(args.max_model_len), "--seed", str(args.seed)]
        if args.trace:
            peer_args += ["--trace", args.trace]
        else:
            peer_args += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        peer = run_peer_subprocess(peer_args, timeout=args.peer_timeout)
        print(f"peer: {json.dumps(peer)[:400]}", file=sys.stderr)
    bundle = load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    reqs = make_requests(args.num_prompts, bundle.config.vocab_size, args.input_len,
                         args.output_len, args.trace, args.max_model_len, args.seed)
    if args.plan:  # the nano-batch pipeline: compare its ablation modes in one run
        modes = args.modes.split(",")
    else:
        modes = {"both": ["sync", "async"], "async": ["async"],
                 "sync": ["sync"]}[args.scheduling]
    results = {}
    for mode in modes:
        forward = None
        if args.plan:
            from nanojax.pipeline.executor import PipelineForward
            from nanojax.pipeline.plan import load_plan
            forward = PipelineForward(bundle.config, load_plan(args.plan), mode)
        try:
            eng = LLMEngine(bundle, EngineConfig(
                b_dense=args.b_dense, num_pages=args.num_pages, page_size=args.page_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                async_scheduling=(mode != "sync"), constant_batch=args.constant_batch,
                admission=args.admission, fixed_shapes=args.fixed_shapes,
                kv_cache_dtype=args.kv_cache_dtype),
                forward=forward)
            results[mode] = run_offline(eng, reqs, progress=not args.quiet)
        except Exception as e:  # record the failure of one mode, measure the others
            if not args.plan:
                raise
            results[mode] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
            print(f"{mode}: failed: {results[mode]['error'][:300]}", file=sys.stderr)
            continue
        finally:
            eng = forward = None
            import gc
            gc.collect()  # the runner's jitted step holds the engine: free its KV cache now
        write_json(args.json, {"command": " ".join(["nanojax"] + sys.argv[1:]),
                               "partial": True, "results": results})
        r = results[mode]
        print(f"{mode:>5}: {r['requests']} requests, {r['prompt_tokens']} prompt + "
              f"{r['output_tokens']} output tokens in {r['wall_s']:.2f}s -> "
              f"{r['total_tokens_per_s']:.1f} tok/s total, {r['output_tokens_per_s']:.1f} "
              f"output tok/s, {r['iterations']} iterations", file=sys.stderr)
    payload = {"command": " ".join(["nanojax"] + sys.argv[1:]), "env": environment(),
               "model": args.model, "workload": {"num_prompts": args.num_prompts,
                                                  "input_len": args.input_len,
                                                  "output_len": args.output_len,
                                                  "trace": args.trace, "seed": args.seed},
               "engine": {"b_dense": args.b_dense, "page_size": args.page_size,
                          "admission": args.admission, "kv_cache_dtype": args.kv_cache_dtype,
                          "num_pages": args.num_pages, "max_model_len": args.max_model_len},
               "results": results}
    if peer is not None:
        # the ratio compares like with like only when the peer served the same requests
        peer["same_requests_as_ours"] = (args.peer_num_prompts or args.num_prompts) \
            == args.num_prompts
        payload["peer"] = peer
        if "error" not in peer:
            payload["ours_over_peer"] = {m: r["total_tokens_per_s"] / peer["total_tokens_per_s"]
                                         for m, r in results.items() if "error" not in r}
    digests = {m: r.pop("output_digests") for m, r in results.items() if "error" not in r}
    if len(digests) > 1:  # greedy decoding: every mode should produce the same tokens
        first = next(iter(digests))
        for m, d in digests.items():
            results[m]["same_outputs_as_" + first] = (
                sum(a == b for a, b in zip(d, digests[first])) / len(d))
    if args.plan:
        ok = {m: r["total_tokens_per_s"] for m, r in results.items() if "error" not in r}
        if "overlap" in ok and "non-overlap" in ok:
            payload["overlap_over_non_overlap"] = ok["overlap"] / ok["non-overlap"]
        if "overlap" in ok and "nanobatch-only" in ok:
            payload["overlap_over_nanobatch_only"] = ok["overlap"] / ok["nanobatch-only"]
    import jax
    if jax.default_backend() == "gpu":
        from nanojax.bench.roofline import CARD_TFLOPS, measure_gemm_rate, optimal_tokens_per_s
        roof = measure_gemm_rate(bundle.config, args.b_dense)
        payload["roofline"] = roof
        for m, r in results.items():
            if "error" not in r:
                r["fraction_of_optimal"] = (r["total_tokens_per_s"]
                                            / roof["optimal_tokens_per_s"])
                r["fraction_of_optimal_at_790_tflops"] = r["total_tokens_per_s"] / (
                    optimal_tokens_per_s(bundle.config, CARD_TFLOPS * 1e12))
    if len(modes) == 2 and not args.plan:
        payload["async_over_sync"] = (results["async"]["total_tokens_per_s"]
                                      / results["sync"]["total_tokens_per_s"])
        print(f"async / sync throughput: {payload['async_over_sync']:.3f}", file=sys.stderr)
    print(json.dumps({k: v for k, v in payload.items() if k in (
        "results", "async_over_sync", "overlap_over_non_overlap",
        "overlap_over_nanobatch_only", "ours_over_peer")}))
    write_json(args.json, payload)
    return 0


def cmd_step(args) -> int:
    from checkpoints.loader import load_model
    from nanojax.bench.step import parse_mode, run_step_bench
    from nanojax.errors import NanojaxError
    from nanojax.pipeline.plan import MODES, load_plan
    try:  # check the arguments before the model loads
        b_dense = [int(b) for b in args.b_dense.split(",")]
        modes = args.modes.split(",")
        for m in modes:
            parse_mode(m)
    except ValueError as e:
        raise NanojaxError(f"bad --b-dense or --modes ({e}): B_dense values are integers; a "
                           f"mode is one of {MODES}, optionally ':SHARE' in (0, 1], "
                           "':nogroups', ':keepinputs' or ':keepall', and ':gemmSHARE'"
                           ) from None
    if any(b <= 0 for b in b_dense):
        raise NanojaxError(f"B_dense must be positive, got {args.b_dense}")
    plan = load_plan(args.plan)
    if args.num_layers:  # a probe on the first layers: the plan is per layer, so it still fits
        plan["model"]["num_layers"] = args.num_layers
    if args.dump_hlo:  # before the backend starts: XLA reads its flags once
        import os
        os.environ["XLA_FLAGS"] = " ".join([
            os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={args.dump_hlo}",
            "--xla_dump_hlo_as_text", "--xla_dump_hlo_module_re=.*step.*"]).strip()
    bundle = load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                        num_layers=args.num_layers)
    out = run_step_bench(bundle, plan, b_dense, args.workloads.split(","),
                         modes, page_size=args.page_size,
                         num_pages=args.num_pages, max_model_len=args.max_model_len,
                         repeats=args.repeats, timeline_png=args.timeline,
                         progress=not args.quiet, f32_reference=args.f32_reference,
                         kv_cache_dtype=args.kv_cache_dtype,
                         checkpoint=lambda part: write_json(args.json, {
                             "command": " ".join(["nanojax"] + sys.argv[1:]), **part}))
    payload = {"command": " ".join(["nanojax"] + sys.argv[1:]), "env": environment(),
               "model": args.model, "num_layers": bundle.config.num_layers,
               "plan": args.plan, "kv_cache_dtype": args.kv_cache_dtype, **out}
    if args.dump_hlo:
        payload["schedule"] = _schedules(args.dump_hlo)
        for name, rep in payload["schedule"].items():
            print(f"schedule {name}: {rep['side_regions']} side-stream regions, "
                  f"{rep['regions_with_a_gemm_between']} with a GEMM before their done",
                  file=sys.stderr)
    for r in out["results"]:
        if "error" in r:
            print(f"B_dense {r['b_dense']:>5} {r['mode']}: failed: {r['error'][:300]}",
                  file=sys.stderr)
            continue
        frac = r.get("fraction_of_optimal")
        print(f"B_dense {r['b_dense']:>5} {r['workload']:>10} {r['mode']:>15}: "
              f"{1e3 * r['step_s']:8.2f} ms/step {r['tokens_per_s']:10.0f} tok/s"
              + (f"  {100 * frac:5.1f}% of optimal" if frac else ""), file=sys.stderr)
    print(json.dumps(out["ratios"]))
    write_json(args.json, payload)
    return 0


def _schedules(dump_dir: str) -> dict:
    """Side-stream schedule report of every optimized step module in a dump directory."""
    from nanojax.bench.hlo_schedule import report
    files = sorted(Path(dump_dir).glob("*after_optimizations.txt"))
    return {f.name: {k: v for k, v in report(f).items() if k != "file"} for f in files}


def cmd_hlo_schedule(args) -> int:
    from nanojax.bench.hlo_schedule import report
    from nanojax.errors import NanojaxError
    try:
        rep = report(args.path)
    except (ValueError, OSError) as e:
        raise NanojaxError(f"cannot read a schedule from {args.path}: {e}") from None
    print(json.dumps(rep, indent=2))
    return 0


def cmd_plot_timeline(args) -> int:
    from nanojax.bench import timeline
    timelines = timeline.reclassify(json.loads(Path(args.events).read_text()))
    timeline.plot(timelines, args.out, args.title)
    print(json.dumps({mode: timeline.summarize(ev) for mode, ev in timelines.items()},
                     indent=1))
    print(f"nanojax: wrote {args.out}", file=sys.stderr)
    return 0


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--trace", default=None,
                   help="splitwise, lmsys, sharegpt, or a TIMESTAMP,ContextTokens,"
                        "GeneratedTokens CSV")
    p.add_argument("--seed", type=int, default=0)


def register(sub) -> None:
    from nanojax.cli import _add_model_args, add_kv_cache_dtype_arg
    bench = sub.add_parser("bench", help="benchmarks: throughput (offline, default) or serve")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser("throughput", help="offline throughput through the engine")
    _add_model_args(t)
    add_kv_cache_dtype_arg(t)
    add_workload_args(t)
    t.add_argument("--b-dense", type=int, default=256, help="tokens per iteration")
    t.add_argument("--page-size", type=int, default=16)
    t.add_argument("--num-pages", type=int, default=None)
    t.add_argument("--max-num-seqs", type=int, default=None)
    t.add_argument("--max-model-len", type=int, default=2048)
    t.add_argument("--constant-batch", action="store_true",
                   help="pad every iteration to B_dense tokens (NanoFlow's dense batch)")
    t.add_argument("--scheduling", choices=["async", "sync", "both"], default="async")
    t.add_argument("--fixed-shapes", action="store_true",
                   help="one row count and page-table width, so every step shape (one per "
                        "token bucket) compiles before the clock starts; without it, shapes "
                        "the warm-up did not meet compile during the run")
    t.add_argument("--admission", choices=["greedy", "predicted"], default="greedy",
                   help="predicted: admit only while everyone's expected final length fits "
                        "the KV cache (NanoFlow's memory prediction; no preemption storms "
                        "when all requests arrive at once)")
    t.add_argument("--plan", default=None,
                   help="run the nano-batch executor with this plan (name or JSON path)")
    t.add_argument("--modes", default="non-overlap,nanobatch-only,overlap",
                   help="with --plan: the ablation modes to compare")
    t.add_argument("--peer", action="store_true",
                   help="also run the workload through transformers' continuous batching "
                        "(GPU, torch present; needs --model random:<shape>)")
    t.add_argument("--peer-num-prompts", type=int, default=None,
                   help="requests for the peer (default: the same as ours)")
    t.add_argument("--peer-timeout", type=float, default=900,
                   help="seconds before the peer's process is stopped (recorded as its error)")
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--json", default=None, help="write the full result here")
    t.set_defaults(func=cmd_throughput)

    st = bsub.add_parser("step", help="time one dense iteration of each pipeline mode on a "
                                      "synthetic steady-state batch (GPU), with a timeline")
    _add_model_args(st)
    add_kv_cache_dtype_arg(st)
    st.add_argument("--plan", required=True, help="plan name or JSON path")
    st.add_argument("--b-dense", default="2048", help="comma-separated B_dense values")
    st.add_argument("--workloads", default="512/512",
                    help="comma-separated PROMPT/OUTPUT pairs or trace names")
    st.add_argument("--modes", default="non-overlap,nanobatch-only,overlap")
    st.add_argument("--page-size", type=int, default=16)
    st.add_argument("--num-pages", type=int, default=16384, help="KV page pool")
    st.add_argument("--max-model-len", type=int, default=2048)
    st.add_argument("--repeats", type=int, default=10)
    st.add_argument("--timeline", default=None,
                    help="write a Gantt PNG (and its events JSON) of one iteration per mode, "
                         "for the first B_dense and workload")
    st.add_argument("--num-layers", type=int, default=None,
                    help="random shapes only: keep the first N layers (quick probes)")
    st.add_argument("--dump-hlo", default=None, metavar="DIR",
                    help="dump the optimized step HLO here and report, per side-stream "
                         "region, the main-stream work XLA scheduled before its done")
    st.add_argument("--f32-reference", action="store_true",
                    help="also run the step in float32 and report each mode's distance "
                         "from it (the yardstick for differences between modes on a GPU)")
    st.add_argument("--quiet", action="store_true")
    st.add_argument("--json", default=None)
    st.set_defaults(func=cmd_step)

    hs = bsub.add_parser("hlo-schedule", help="side-stream regions of an optimized HLO dump "
                                              "and the work scheduled beside each")
    hs.add_argument("path", help="an *after_optimizations.txt file or a dump directory")
    hs.set_defaults(func=cmd_hlo_schedule)

    pt = bsub.add_parser("plot-timeline", help="render a timeline events JSON as a PNG")
    pt.add_argument("events")
    pt.add_argument("--out", required=True)
    pt.add_argument("--title", default="one iteration")
    pt.set_defaults(func=cmd_plot_timeline)
    try:
        from nanojax.bench.serve import register_serve
        register_serve(bsub)
    except ModuleNotFoundError as e:
        if e.name != "nanojax.bench.serve":
            raise
