"""Offline throughput: push a whole workload through the engine, count what came out."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import signal
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from nanojax.bench.steady import steady_state
from nanojax.bench.workload import BenchRequest, StructuredWorkload
from nanojax.engine.gc_freeze import GcPauses, frozen_startup_objects
from nanojax.engine.kv_cache import device_memory
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class TimelineWindow:
    """Profile `iterations` engine iterations from the run's `at`-th; events to `path`.
    host: Python's cProfile of the engine thread instead of the device timeline (its
    stats to `path`, the top functions beside it as text)."""
    path: str
    at: int = 600
    iterations: int = 6
    host: bool = False


def timeline_window(args, mode: str, modes: list[str]) -> TimelineWindow | None:
    """The --timeline (or --host-profile) window of one mode's run (one file per mode
    when there are several)."""
    path = args.timeline or getattr(args, "host_profile", None)
    if not path:
        return None
    path = path if len(modes) == 1 else f"{path}.{mode}"
    return TimelineWindow(path, args.timeline_at, args.timeline_iterations,
                          host=not args.timeline)


def run_with_window(engine: LLMEngine, advance, window: TimelineWindow | None) -> dict | None:
    """Runs advance(max_steps) (steps the engine until idle, or max_steps steps; None:
    no limit) to the end, with the window's iterations under the profiler: is the device
    busy through them (the step itself is slower than the step benchmark's) or idle
    between steps (the host holds the next launch back)? Returns the window's report.
    The raw trace (host phases included) goes beside the events, as .trace.json.gz."""
    if window is None:
        advance(None)
        return None
    from nanojax.profiling import timeline
    start = engine.stats.steps
    advance(window.at)
    first = engine.stats.steps - start
    if window.host:
        return _host_profile(engine, advance, window, first)
    raw = str(Path(window.path).with_suffix(".trace.json.gz"))
    trace = (timeline.capture_raw(lambda: advance(window.iterations), keep_trace=raw)
             if not engine.is_idle else None)
    advance(None)
    events = timeline.parse_trace(trace) if trace else []  # after the run: no stall in it
    Path(window.path).parent.mkdir(parents=True, exist_ok=True)
    Path(window.path).write_text(json.dumps({"engine": events}))
    return {"path": window.path, "raw_trace": raw, "first_iteration": first,
            "iterations": window.iterations, **timeline.summarize(events)}


def _run(engine: LLMEngine, bar, window: TimelineWindow | None,
         stop: threading.Event) -> tuple[dict, dict | None]:
    done = {}
    report = run_with_window(
        engine, lambda n: engine.run_to_completion(bar, n, done, stop), window)
    return done, report


@contextlib.contextmanager
def stop_when(time_limit: float | None):
    """An event set after time_limit seconds, or on SIGTERM (a `timeout` around the
    benchmark): the run stops between iterations and still reports what it measured."""
    stop = threading.Event()
    timer = threading.Timer(time_limit, stop.set) if time_limit else None
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if main else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield stop
    finally:
        if timer is not None:
            timer.cancel()
        if main:
            signal.signal(signal.SIGTERM, previous)


def _host_profile(engine: LLMEngine, advance, window: TimelineWindow, first: int) -> dict:
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    steps, host = engine.stats.steps, engine.stats.host_s
    profiler.enable()
    advance(window.iterations)
    profiler.disable()
    n = max(1, engine.stats.steps - steps)
    host_ms = 1e3 * (engine.stats.host_s - host) / n
    advance(None)
    profiler.dump_stats(window.path)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(40)
    Path(window.path + ".txt").write_text(text.getvalue())
    return {"host_profile": window.path, "first_iteration": first, "iterations": n,
            "host_ms_per_iteration_profiled": host_ms}


def _params(requests: list[BenchRequest], structured: StructuredWorkload | None,
            max_tokens: int | None = None) -> list[SamplingParams]:
    """Greedy, EOS ignored (every request runs to its length); the structured workload's
    rows under its constraint, which may end them earlier ("stop")."""
    rows = structured.rows(len(requests)) if structured else [False] * len(requests)
    return [SamplingParams(max_tokens=max_tokens or r.output_len, ignore_eos=True,
                           temperature=0, output_kind="final_only",
                           structured_outputs=structured.constraint() if row else None)
            for r, row in zip(requests, rows)]


def _structured_report(structured: StructuredWorkload, outs: list) -> dict:
    """How the constrained and the other requests ended ("stop": the grammar completed;
    "unfinished": a stopped run's, None in outs)."""
    rows = structured.rows(len(outs))
    reasons = {"constrained": {}, "unconstrained": {}}
    for row, out in zip(rows, outs):
        counts = reasons["constrained" if row else "unconstrained"]
        reason = out.finish_reason if out is not None else "unfinished"
        counts[reason] = counts.get(reason, 0) + 1
    return {"fraction": structured.fraction, "schema": structured.schema,
            "requests": sum(rows), "finish_reasons": reasons}


def run_offline(engine: LLMEngine, requests: list[BenchRequest], progress: bool = True,
                warmup: bool = True, timeline: TimelineWindow | None = None,
                structured: StructuredWorkload | None = None,
                keep_outputs: bool = False, time_limit: float | None = None) -> dict:
    """Tokens are counted from the outputs actually produced, not from the request list.
    The result's "steady_state" is the report of bench/steady.py: fill, tokens/s, host time
    and preemptions in the window where the engine was saturated; with a timeline window,
    "timeline" summarizes the profiled iterations (their events go to its path).
    structured: which requests are under a JSON schema ("structured" in the result: the
    fraction, the schema and how they ended). keep_outputs: each request's output token
    ids as "outputs" (tests). time_limit: seconds after which the timed run stops (so
    does SIGTERM): "complete" is then false, and the tokens counted are every one
    produced, the unfinished requests' included."""
    t_warmup = time.perf_counter()
    if warmup and engine.offloader is not None:  # the KV offload's page copies
        engine.offloader.warmup()
    if warmup and engine.runner.fixed_shapes:  # every shape it can launch, before timing
        engine.runner.warmup()
    elif warmup:  # compile the common shapes outside the timed region, with prompts that
        # share no prefix with the workload's (a warm-up must not seed the prefix cache)
        vocab = engine.model_config.vocab_size
        head = requests[: min(len(requests), engine.scheduler.max_num_seqs)]
        for r, params in zip(head, _params(head, structured, max_tokens=4)):
            engine.add_request([(t + 1) % vocab for t in r.prompt_ids[:64]], params)
        engine.run_to_completion()
    warmup_s = time.perf_counter() - t_warmup
    compiles_before = engine.runner.num_compiles + engine.runner.num_sampler_compiles
    steps_before, tokens_before = engine.stats.steps, engine.stats.scheduled_tokens
    host_before, wait_before = engine.stats.host_s, engine.stats.wait_s
    engine.stats.trace = []  # one record per iteration, for the steady-state report
    ids = [engine.add_request(r.prompt_ids, params)
           for r, params in zip(requests, _params(requests, structured))]
    t0 = time.perf_counter()
    # the freeze held across the whole run: run_with_window steps the engine in pieces
    # (to the timeline's window, through it, to the end), and each run_to_completion
    # releases its own hold: without this, every startup object was unfrozen around the
    # profiler's window (the likely source of a 794 ms full collection, fp8.md §87)
    with (tqdm(total=len(ids), desc="requests", unit="req", disable=not progress) as bar,
          frozen_startup_objects(engine.config.gc_freeze), GcPauses() as gc_pauses,
          stop_when(time_limit) as stop):
        done, timeline_report = _run(engine, bar, timeline, stop)
    wall = time.perf_counter() - t0
    trace, engine.stats.trace = engine.stats.trace, None
    iterations = max(1, engine.stats.steps - steps_before)
    digests = [hashlib.sha1(str(done[i].token_ids).encode()).hexdigest()[:12]
               if i in done else None for i in ids]
    # a stopped run: the unfinished requests' tokens so far count too (prefilled ones)
    running = [engine.requests[i] for i in ids if i not in done and i in engine.requests]
    prompt_tokens = (sum(len(done[i].prompt_token_ids) for i in done)
                     + sum(len(s.prompt_ids) for s in running if s.output_ids))
    output_tokens = (sum(len(done[i].token_ids) for i in done)
                     + sum(len(s.output_ids) for s in running))
    return {
        "complete": len(done) == len(ids),  # false: stopped by time_limit or SIGTERM
        "time_limit_s": time_limit,
        "requests": len(ids),
        "finished_requests": len(done),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
        "output_tokens_per_s": output_tokens / wall,
        "requests_per_s": len(ids) / wall,
        "iterations": engine.stats.steps - steps_before,
        # how full the dense batches were: NanoFlow's throughput assumes ~1
        "mean_batch_fill": ((engine.stats.scheduled_tokens - tokens_before)
                            / max(1, engine.stats.steps - steps_before)
                            / engine.config.b_dense),
        # where the wall time goes (EngineStats): the host's own work per iteration, and
        # the share of the run the host sat waiting for the device (the rest: host-bound)
        "host_ms_per_iteration": 1e3 * (engine.stats.host_s - host_before) / iterations,
        "device_wait_share": (engine.stats.wait_s - wait_before) / wall,
        "preemptions": engine.scheduler.num_preemptions,
        "warmup_s": warmup_s,  # compiling before the timed run (fixed shapes: all of it)
        "compiles_during_run": (engine.runner.num_compiles
                                + engine.runner.num_sampler_compiles - compiles_before),
        # the collector's pauses on the engine thread (the loop runs with gc.freeze)
        "gc": gc_pauses.report(),
        # the engine's configuration with every default resolved (dense batch, admission,
        # buckets, dispatch thread ...): what "no tuning flags" ran
        "engine_config": engine.config.to_dict(),
        "kv_pages": engine.sizing.num_pages,
        # the allocator's peak over the process (weights, cache, the steps' activations):
        # how much of jax's pool the KV cache's share left unused (None on the CPU)
        "device_memory": device_memory(),
        # the peak as the warm-up went: after the step shapes, after the samplers
        "warmup_memory": engine.runner.warmup_memory,
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "steady_state": steady_state(trace, engine.config.b_dense, 1 + (
            output_tokens / len(ids) if len(done) == len(ids)
            else sum(r.output_len for r in requests) / max(1, len(requests))),
            engine.runner.step_tokens),
        "output_digests": digests,  # per request, to compare modes' tokens
        **({"timeline": timeline_report} if timeline_report else {}),
        **({"structured": _structured_report(structured, [done.get(i) for i in ids])}
           if structured else {}),
        **({"outputs": [done[i].token_ids if i in done else None for i in ids]}
           if keep_outputs else {}),
    }
