"""`nanojax bench [throughput] ...` (offline) and `nanojax bench serve ...` (online)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nanojax.bench.workload import add_workload_args, structured_fraction
from nanojax.config_flags import (add_engine_args, add_model_args, engine_config_from_args,
                                  kernel_config_from_args)
from nanojax.bench.serve import register_serve
from nanojax.profiling.record import run_record, write_json


def _run_peer(args, max_model_len: int) -> dict:
    """transformers on the same requests, in its own process, before JAX holds the GPU."""
    from nanojax.bench.peer import run_peer_subprocess
    if not args.model.startswith("random:"):
        raise SystemExit("nanojax: --peer needs --model random:<shape>")
    n = args.peer_num_prompts or args.num_prompts
    peer_args = ["--shape", args.model.split(":", 1)[1], "--num-prompts", str(n),
                 "--max-model-len", str(max_model_len), "--seed", str(args.seed)]
    if args.trace:
        peer_args += ["--trace", args.trace]
    else:
        peer_args += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    peer = run_peer_subprocess(peer_args, timeout=args.peer_timeout)
    print(f"peer: {json.dumps(peer)[:400]}", file=sys.stderr)
    # the ratio compares like with like only when the peer served the same requests
    peer["same_requests_as_ours"] = n == args.num_prompts
    return peer


def _run_modes(args, bundle, reqs, config, modes: list[str], partial: dict,
               grammar_tokenizer=None) -> dict:
    """mode -> offline result (or {"error"} for a plan mode that failed)."""
    import gc

    from nanojax.bench.offline import run_offline
    from nanojax.bench.workload import structured_workload
    from nanojax.engine.llm_engine import LLMEngine
    from nanojax.parallel.multihost import is_leader
    results = partial["results"]
    for mode in modes:
        forward = eng = None
        try:
            if args.plan:
                from nanojax.pipeline.executor import PipelineForward
                from nanojax.pipeline.plan import load_plan
                forward = PipelineForward(bundle.config, load_plan(args.plan), mode,
                                          kernels=config.kernels,
                                          tp=config.tensor_parallel_size)
            if mode in ("sync", "async"):
                config = config.replace(async_scheduling=mode == "async")
            eng = LLMEngine(bundle, config, forward=forward)
            if grammar_tokenizer is not None:  # --tokenizer
                eng.use_grammar_tokenizer(grammar_tokenizer)
            if not is_leader():  # process 0 schedules; this one runs its steps
                eng.runner.follow()
                continue
            from nanojax.bench.offline import timeline_window
            results[mode] = run_offline(eng, reqs, progress=not args.quiet,
                                        timeline=timeline_window(args, mode, modes),
                                        structured=structured_workload(args),
                                        time_limit=args.time_limit)
            eng.runner.stop_followers()
        except Exception as e:  # record the failure of one mode, measure the others
            if not args.plan:
                raise
            results[mode] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
            print(f"{mode}: failed: {results[mode]['error'][:300]}", file=sys.stderr)
            continue
        finally:
            eng = forward = None
            gc.collect()  # the runner's jitted step holds the engine: free its KV cache now
        write_json(args.json, {**partial, "partial": True})
        r = results[mode]
        print(f"{mode:>5}: {r['requests']} requests, {r['prompt_tokens']} prompt + "
              f"{r['output_tokens']} output tokens in {r['wall_s']:.2f}s -> "
              f"{r['total_tokens_per_s']:.1f} tok/s total, {r['output_tokens_per_s']:.1f} "
              f"output tok/s, {r['iterations']} iterations"
              + ("" if r["complete"] else f" (stopped: {r['finished_requests']} finished)"),
              file=sys.stderr)
        print(f"{mode:>5}: steady state: {_steady_line(r['steady_state'])}", file=sys.stderr)
        left = (r.get("warmup_memory") or {}).get("pages_left_at_peak")
        if left:
            from nanojax.engine.kv_cache import headroom_line
            print(f"{mode:>5}: {headroom_line(r['kv_pages'], left)}", file=sys.stderr)
    return results


def _steady_line(st: dict) -> str:
    if st["window"] is None:
        return st["why_no_window"]
    first, last = st["window"]
    line = (f"iterations {first}-{last}, mean fill {st['mean_fill']:.3f}, "
            f"{st['preemptions']} preemptions, host {st['host_ms_per_iteration']:.1f} "
            f"ms/iteration (launch {st['launch_ms_per_iteration']:.1f}, of it inputs "
            f"{st['inputs_ms_per_iteration']:.1f})")
    if "tokens_per_s" in st:
        line += (f", {st['tokens_per_s']:.1f} tok/s ({1e3 * st['s_per_iteration']:.1f} "
                 f"ms/iteration, median {st['iteration_ms']['p50']:.1f}, stalls "
                 f"{st['iteration_ms']['stall_ms_per_iteration']:.1f}; device wait "
                 f"{100 * st['device_wait_share']:.0f}%)")
    return line


def _compare_modes(payload: dict, results: dict, plan: bool) -> None:
    """Same tokens across modes (greedy), and the throughput ratios between them."""
    digests = {m: r.pop("output_digests") for m, r in results.items() if "error" not in r}
    if len(digests) > 1:
        first = next(iter(digests))
        for m, d in digests.items():
            results[m]["same_outputs_as_" + first] = (
                sum(a == b for a, b in zip(d, digests[first])) / len(d))
    ok = {m: r["total_tokens_per_s"] for m, r in results.items() if "error" not in r}
    if plan:
        if "overlap" in ok and "non-overlap" in ok:
            payload["overlap_over_non_overlap"] = ok["overlap"] / ok["non-overlap"]
        if "overlap" in ok and "nanobatch-only" in ok:
            payload["overlap_over_nanobatch_only"] = ok["overlap"] / ok["nanobatch-only"]
    elif "async" in ok and "sync" in ok:
        payload["async_over_sync"] = ok["async"] / ok["sync"]
        print(f"async / sync throughput: {payload['async_over_sync']:.3f}", file=sys.stderr)


def _add_roofline(payload: dict, results: dict, cfg, b_dense: int) -> None:
    """% of optimal, with the GEMM rate measured here for the model's shapes (GPU)."""
    from nanojax.bench.roofline import CARD_TFLOPS, measure_gemm_rate, optimal_tokens_per_s
    roof = measure_gemm_rate(cfg, b_dense)
    payload["roofline"] = roof
    for r in results.values():
        if "error" not in r:
            r["fraction_of_optimal"] = r["total_tokens_per_s"] / roof["optimal_tokens_per_s"]
            r["fraction_of_optimal_at_790_tflops"] = r["total_tokens_per_s"] / (
                optimal_tokens_per_s(cfg, CARD_TFLOPS * 1e12))


def _grammar_tokenizer(args, bundle):
    """--tokenizer's tokenizer (for a model without one), else None; refused where the
    model has its own or where a structured run has no tokenizer at all."""
    from nanojax.bench.workload import load_tokenizer
    from nanojax.errors import NanojaxError
    if args.tokenizer is None:
        if args.structured_fraction and bundle.tokenizer is None:
            raise NanojaxError(f"--structured-fraction: {args.model} has no tokenizer to "
                               "compile a grammar against; give --tokenizer NAME_OR_DIR")
        return None
    if bundle.tokenizer is not None:
        raise NanojaxError(f"--tokenizer: {args.model} has its own tokenizer")
    return load_tokenizer(args.tokenizer, args.cache_dir)  # the engine checks its vocab


def cmd_throughput(args) -> int:
    import jax

    from nanojax.parallel.multihost import init_distributed, is_leader

    from nanojax.bench.workload import make_requests, structured_workload
    from nanojax.errors import NanojaxError
    from nanojax.plugins import model_loader
    config = engine_config_from_args(args)
    peer = _run_peer(args, config.max_model_len) if args.peer else None
    init_distributed(args)
    bundle = model_loader().load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                                       num_layers=args.num_layers,
                                       tensor_parallel_size=config.tensor_parallel_size,
                                       quantization=args.quantization)
    if args.multi_round or args.reuse_modes:  # conversations, KV reuse modes compared
        if args.structured_fraction or args.tokenizer:
            raise NanojaxError("--structured-fraction and --tokenizer apply to single-round "
                               "runs, not --multi-round / --reuse-modes")
        from nanojax.bench.multi_round import cmd_multi_round
        return cmd_multi_round(args, bundle)
    grammar_tokenizer = _grammar_tokenizer(args, bundle)
    reqs = make_requests(args.num_prompts, bundle.config.vocab_size, args.input_len,
                         args.output_len, args.trace, config.max_model_len, args.seed)
    if args.max_model_len is None:  # the workload's longest request: what the cache holds
        config = config.replace(max_model_len=max(len(r.prompt_ids) + r.output_len
                                                  for r in reqs))  # (sizes B_dense on a GPU)
    if args.plan:  # the nano-batch pipeline: compare its ablation modes in one run
        modes = args.modes.split(",")
    else:
        modes = {"both": ["sync", "async"], "async": ["async"],
                 "sync": ["sync"]}[args.scheduling]
    structured = structured_workload(args)
    payload = {**run_record(config, bundle.config), "model": args.model, "plan": args.plan,
               "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                            "output_len": args.output_len, "trace": args.trace,
                            "seed": args.seed, "structured_fraction": structured.fraction,
                            "structured_schema": structured.schema,
                            "grammar_tokenizer": args.tokenizer},
               "results": {}}
    results = _run_modes(args, bundle, reqs, config, modes, payload, grammar_tokenizer)
    if not is_leader():  # the other processes ran process 0's steps
        return 0
    if peer is not None:
        payload["peer"] = peer
        if "error" not in peer:
            payload["ours_over_peer"] = {m: r["total_tokens_per_s"] / peer["total_tokens_per_s"]
                                         for m, r in results.items() if "error" not in r}
    _compare_modes(payload, results, bool(args.plan))
    if jax.default_backend() == "gpu":
        b_dense = next((r["engine_config"]["b_dense"] for r in results.values()
                        if "engine_config" in r), config.dense_batch())
        _add_roofline(payload, results, bundle.config, b_dense)
    print(json.dumps({k: v for k, v in payload.items() if k in (
        "results", "async_over_sync", "overlap_over_non_overlap",
        "overlap_over_nanobatch_only", "ours_over_peer")}))
    write_json(args.json, payload)
    return 0


def cmd_schedule(args) -> int:
    """The scheduler alone on a workload (schedule_sim.py): batch fill and steady window."""
    from nanojax.bench.schedule_sim import simulate_report
    from nanojax.bench.workload import make_requests
    from nanojax.errors import NanojaxError
    if args.num_pages * args.page_size < args.max_model_len:
        raise NanojaxError(f"--num-pages {args.num_pages} x --page-size {args.page_size} "
                           f"cannot hold one request of --max-model-len {args.max_model_len}")
    reqs = make_requests(args.num_prompts, 2, args.input_len, args.output_len, args.trace,
                         args.max_model_len, args.seed)
    lengths = [(len(r.prompt_ids), r.output_len) for r in reqs]
    out = simulate_report(lengths, args.b_dense, num_pages=args.num_pages,
                          page_size=args.page_size, admission=args.admission,
                          max_num_seqs=args.max_num_seqs or args.b_dense,
                          max_model_len=args.max_model_len,
                          max_prefill_seqs=args.max_prefill_seqs)
    payload = {**run_record(None), "workload": {
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "trace": args.trace, "seed": args.seed}, **out}
    write_json(args.json, payload)
    print(f"{out['iterations']} iterations, mean fill {out['mean_batch_fill']:.3f}, "
          f"{out['preemptions']} preemptions; steady state: "
          f"{_steady_line(out['steady_state'])}", file=sys.stderr)
    print(json.dumps({k: v for k, v in out.items() if k != "steady_state"}
                     | {"steady_state": {k: v for k, v in out["steady_state"].items()
                                         if k != "definition"}}))
    return 0


def cmd_host(args) -> int:
    """The host loop alone (host.py), at each running count."""
    from nanojax.bench.host import HostBenchConfig, python_reference_ms, run_host_bench
    from nanojax.errors import NanojaxError
    try:
        counts = [int(n) for n in args.running.split(",")]
    except ValueError:
        raise NanojaxError(f"--running takes integers, got {args.running!r}") from None
    if any(n <= 0 for n in counts) or args.input_len <= 0 or args.output_len < 2:
        raise NanojaxError("--running and --input-len must be positive, --output-len >= 2")
    runs = []
    for n in counts:
        cfg = HostBenchConfig(running=n, input_len=args.input_len,
                              output_len=args.output_len, shape=args.shape,
                              structured_fraction=args.structured_fraction,
                              async_dispatch=args.async_dispatch)
        run = run_host_bench(cfg, f"{args.profile}.{n}" if args.profile else None)
        runs.append(run)
        print(f"running {n}: host {run['host_ms_per_iteration']:.2f} ms/iteration "
              f"(schedule {run['schedule_ms_per_iteration']:.2f}, launch "
              f"{run['launch_ms_per_iteration']:.2f} of it inputs "
              f"{run['inputs_ms_per_iteration']:.2f}, process "
              f"{run['process_ms_per_iteration']:.2f}), mean running "
              f"{run['mean_running']:.0f}", file=sys.stderr)
    payload = {**run_record(None), "python_reference_ms": python_reference_ms(),
               "runs": runs}
    write_json(args.json, payload)
    print(json.dumps(payload["runs"]))
    return 0


def _sustained_text(s: dict | None) -> str:
    if not s:
        return ""
    p = s.get("power") or {}
    frac = s.get("fraction_of_optimal")
    return (f"  sustained {1e3 * s['step_s']:.2f} ms"
            + (f" {100 * frac:.1f}%" if frac else "")
            + (f" at {p['power_w_mean']:.0f} W, {p['sm_clock_mhz_mean']:.0f} MHz"
               if p.get("samples") else ""))


def cmd_step(args) -> int:
    from nanojax.bench.step import mode_options, parse_mode, run_step_bench
    from nanojax.errors import NanojaxError
    from nanojax.pipeline.plan import MODES, load_plan
    from nanojax.plugins import model_loader
    try:  # check the arguments before the model loads
        b_dense = [int(b) for b in args.b_dense.split(",")]
        modes = args.modes.split(",")
        for m in modes:
            parse_mode(m)
    except ValueError as e:
        raise NanojaxError(f"bad --b-dense or --modes ({e}): B_dense values are integers; a "
                           f"mode is one of {MODES}, optionally ':SHARE' in (0, 1], then "
                           f"any of {mode_options()}") from None
    if any(b <= 0 for b in b_dense):
        raise NanojaxError(f"B_dense must be positive, got {args.b_dense}")
    if not 0 <= args.sustain_seconds < 3600:  # NaN and inf too: a held run must end
        raise NanojaxError(f"--sustain-seconds must be in [0, 3600), got {args.sustain_seconds}")
    if args.max_num_seqs is not None and args.max_num_seqs <= 0:
        raise NanojaxError(f"--max-num-seqs must be positive, got {args.max_num_seqs}")
    plan = load_plan(args.plan)
    if args.num_layers:  # a probe on the first layers: the plan is per layer, so it still fits
        plan["model"]["num_layers"] = args.num_layers
    if args.dump_hlo:  # before the backend starts: XLA reads its flags once
        import os
        os.environ["XLA_FLAGS"] = " ".join([
            os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={args.dump_hlo}",
            "--xla_dump_hlo_as_text", "--xla_dump_hlo_module_re=.*step.*"]).strip()
    bundle = model_loader().load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                                       num_layers=args.num_layers,
                                       tensor_parallel_size=args.tensor_parallel_size,
                                       quantization=args.quantization)
    kernels = kernel_config_from_args(args)
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    record = {**run_record(kernels, bundle.config), "model": args.model, "plan": args.plan,
              "tensor_parallel_size": args.tensor_parallel_size,
              "kv_cache_dtype": kv_cache_dtype, "max_num_seqs": args.max_num_seqs}
    out = run_step_bench(bundle, plan, b_dense, args.workloads.split(","),
                         modes, page_size=args.page_size,
                         num_pages=args.num_pages, max_model_len=args.max_model_len,
                         repeats=args.repeats, timeline_png=args.timeline,
                         progress=not args.quiet, f32_reference=args.f32_reference,
                         kernels=kernels, tp=args.tensor_parallel_size,
                         kv_cache_dtype=kv_cache_dtype, max_num_seqs=args.max_num_seqs,
                         sustain_s=args.sustain_seconds,
                         checkpoint=lambda part: write_json(args.json, {**record, **part}))
    payload = {**record, "num_layers": bundle.config.num_layers, **out}
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
              + (f"  {100 * frac:5.1f}% of optimal" if frac else "")
              + f"  (pipelined {1e3 * r['pipelined_step_s']:.2f} ms)"
              + _sustained_text(r.get("sustained")), file=sys.stderr)
    print(json.dumps(out["ratios"]))
    write_json(args.json, payload)
    return 0


def _schedules(dump_dir: str) -> dict:
    """Side-stream schedule report of every optimized step module in a dump directory."""
    from nanojax.profiling.hlo_schedule import report
    files = sorted(Path(dump_dir).glob("*after_optimizations.txt"))
    return {f.name: {k: v for k, v in report(f).items() if k != "file"} for f in files}


def cmd_hlo_schedule(args) -> int:
    from nanojax.profiling.hlo_schedule import report
    from nanojax.errors import NanojaxError
    try:
        rep = report(args.path)
    except (ValueError, OSError) as e:
        raise NanojaxError(f"cannot read a schedule from {args.path}: {e}") from None
    print(json.dumps(rep, indent=2))
    return 0


def cmd_plot_timeline(args) -> int:
    from nanojax.profiling import timeline
    timelines = timeline.reclassify(json.loads(Path(args.events).read_text()))
    timeline.plot(timelines, args.out, args.title)
    print(json.dumps({mode: timeline.summarize(ev) for mode, ev in timelines.items()},
                     indent=1))
    print(f"nanojax: wrote {args.out}", file=sys.stderr)
    return 0


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput (offline, default) or serve")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser("throughput", help="offline throughput through the engine")
    add_model_args(t)
    add_workload_args(t)
    add_engine_args(t, skip=("async_scheduling",))
    from nanojax.bench.workload import add_structured_args
    add_structured_args(t)
    t.add_argument("--scheduling", choices=["async", "sync", "both"], default="async")
    t.add_argument("--num-layers", type=int, default=None,
                   help="random:<shape> cut to its first layers (a quicker probe)")
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
    # unset: the workload's longest request (the trace's, kept to 2,048 tokens)
    t.set_defaults(max_model_len=None)
    t.add_argument("--timeline", default=None, metavar="PATH",
                   help="profile a few engine iterations mid-run (device kernels and the "
                        "host's launches) and write their events JSON here; the result "
                        "gains the device's busy share of those iterations")
    t.add_argument("--timeline-at", type=int, default=600, metavar="N",
                   help="start the timeline at the run's N-th iteration (default: 600, "
                        "inside the steady window of 512/512)")
    t.add_argument("--timeline-iterations", type=int, default=6, metavar="N")
    from nanojax.config_flags import positive_seconds
    t.add_argument("--time-limit", type=positive_seconds, default=None, metavar="S",
                   help="stop the timed run after S seconds (as on SIGTERM) and report what "
                        "it measured, marked complete: false (the steady window holds)")
    t.add_argument("--host-profile", default=None, metavar="PATH",
                   help="instead of --timeline: Python's cProfile of the engine thread over "
                        "the same iterations (stats here, the top functions in PATH.txt)")
    from nanojax.bench.multi_round import add_multi_round_args
    add_multi_round_args(t)
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--json", default=None, help="write the full result here")
    from nanojax.parallel.multihost import add_distributed_args
    add_distributed_args(t)
    t.set_defaults(func=cmd_throughput)

    sc = bsub.add_parser("schedule", help="the scheduler alone, no model: batch fill and "
                                          "the steady-state window of a workload (seconds "
                                          "on the CPU for a GPU-sized configuration)")
    add_workload_args(sc)
    sc.add_argument("--b-dense", type=int, default=2048)
    sc.add_argument("--num-pages", type=int, required=True, help="KV pages")
    sc.add_argument("--page-size", type=int, default=16)
    sc.add_argument("--max-num-seqs", type=int, default=None,
                    help="most requests running at once (default: B_dense)")
    sc.add_argument("--max-model-len", type=int, default=2048)
    sc.add_argument("--max-prefill-seqs", type=int, default=None,
                    help="most sequences prefilling in one iteration (the chunked-prefill "
                         "kernel's prefill_max_seqs; default: no limit)")
    from nanojax.config import ADMISSION
    sc.add_argument("--admission", choices=ADMISSION, default="predicted")
    sc.add_argument("--json", default=None)
    sc.set_defaults(func=cmd_schedule)

    ho = bsub.add_parser("host", help="the engine's host loop around a stand-in model of "
                                      "a real one's shapes (no device work): host ms per "
                                      "iteration at each running count")
    ho.add_argument("--running", default="1000,2000,4000",
                    help="requests decoding at once, comma-separated (one run each)")
    ho.add_argument("--input-len", type=int, default=128)
    ho.add_argument("--output-len", type=int, default=128,
                    help="mean output; each drawn from [out/2, 3 out/2]")
    ho.add_argument("--shape", default="llama3-8b",
                    help="the model shape whose layers the stand-in's parameters mimic")
    ho.add_argument("--profile", default=None, metavar="PATH",
                    help="cProfile stats of each run's steady iterations (PATH.<running>)")
    ho.add_argument("--structured-fraction", type=structured_fraction, default=0.0,
                    help="share of the requests under a JSON schema (their grammars "
                         "against SmolLM2's tokenizer, the stand-in's vocabulary widened "
                         "to it)")
    ho.add_argument("--async-dispatch", action=argparse.BooleanOptionalAction, default=None,
                    help="dispatch steps from the runner's thread (default: the platform's, "
                         "on a GPU on)")
    ho.add_argument("--json", default=None)
    ho.set_defaults(func=cmd_host)

    st = bsub.add_parser("step", help="time one dense iteration of each pipeline mode on a "
                                      "synthetic steady-state batch (GPU), with a timeline")
    add_model_args(st)
    st.add_argument("--plan", required=True, help="plan name or JSON path")
    st.add_argument("--b-dense", default="2048", help="comma-separated B_dense values")
    st.add_argument("--workloads", default="512/512",
                    help="comma-separated PROMPT/OUTPUT pairs or trace names")
    st.add_argument("--modes", default="non-overlap,nanobatch-only,overlap")
    st.add_argument("--page-size", type=int, default=16)
    st.add_argument("--num-pages", type=int, default=16384, help="KV page pool")
    st.add_argument("--max-model-len", type=int, default=2048)
    st.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engine's sequence limit: batches get its row count (page "
                         "table, LM head rows), the runner's bucket of it (default: the most "
                         "sequences of any workload's batch at that B_dense)")
    st.add_argument("--repeats", type=int, default=10)
    st.add_argument("--sustain-seconds", type=float, default=0.0, metavar="X",
                    help="also run each mode and batch back to back for X seconds with the "
                         "SM clock and board power sampled (nvidia-smi, GPU 0): the rate "
                         "held at the card's power cap, where a 10-step burst may run "
                         "faster (default: 0, off)")
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
    add_engine_args(st, kernels_only=True)
    add_engine_args(st, only=("kv_cache_dtype",))
    st.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="one process over this many GPUs (the plan must be for this tp)")
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
    register_serve(bsub)
    from nanojax.bench.latency import register_latency
    register_latency(bsub)
