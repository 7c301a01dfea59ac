"""Steady state: a saturated engine keeps its dense batch full, and the benchmark's
steady-state report says so consistently (issue 20 item 1)."""
import numpy as np
import pytest

from nanojax.bench.schedule_sim import simulate_report
from nanojax.bench.steady import steady_state
from nanojax.engine.kv_cache import PageAllocator
from nanojax.engine.llm_engine import EngineConfig, IterationRecord, LLMEngine
from nanojax.engine.sampling import SamplingParams
from nanojax.engine.scheduler import Scheduler, predicted_peak
from nanojax.engine.sequence import Sequence


def test_saturated_tiny_engine_keeps_the_batch_full(tiny_bundle):
    """5x more 32/32 requests than the cache holds at their full length (480 pages of 4
    tokens: 30 of 64 tokens); the steady state needs ~32 decodes at a mean context of 48
    (~400 pages), which fits. Reserving each request's final length admitted 30 at a time
    and left the window 86% full; the predicted peak and the pace keep it full."""
    from nanojax.bench.offline import run_offline
    from nanojax.bench.workload import make_requests
    eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=64, page_size=4, num_pages=480,
                                              max_model_len=64, admission="predicted",
                                              fixed_shapes=True))
    reqs = make_requests(150, tiny_bundle.config.vocab_size, 32, 32, seed=1)
    r = run_offline(eng, reqs, progress=False)
    st = r["steady_state"]
    assert st["window"] is not None, st
    first, last = st["window"]
    assert st["ramp_iterations"] == 33 == first  # mean stay: 32 outputs + 1
    assert last == r["iterations"] - 1 - st["drain_iterations"]
    assert st["window_iterations"] == last - first + 1 > 80
    assert st["mean_fill"] >= 0.9, st
    assert st["preemptions"] == 0 and r["preemptions"] == 0
    # consistency: the window is part of the run, its tokens part of all the tokens
    assert st["total_tokens"] == 150 * (32 + 32 - 1)  # the last output needs no decode
    assert st["window_tokens"] <= st["total_tokens"]
    assert st["window_tokens"] == round(st["mean_fill"] * 64 * st["window_iterations"])
    assert 0 < st["window_s"] <= r["wall_s"]
    assert st["tokens_per_s"] == pytest.approx(st["window_tokens"] / st["window_s"])
    assert st["tokens_per_s"] <= st["tokens_per_s_at_full_fill"] * (1 + 1e-9)
    assert 0 <= st["device_wait_share"] <= 1 and st["host_ms_per_iteration"] > 0
    assert 0 < st["launch_ms_per_iteration"] <= st["host_ms_per_iteration"]
    assert st["max_running"] <= r["max_num_seqs"]
    assert r["kv_pages"] == 480
    # per step shape: every window iteration under the shape its tokens pad to
    shapes = st["by_shape"]
    assert sum(g["iterations"] for g in shapes.values()) == st["window_iterations"]
    for shape, g in shapes.items():
        assert int(shape) == eng.runner.step_tokens(round(g["mean_tokens"]))
        assert 0 < g["p50_ms"] and 0 < g["mean_ms"] and g["mean_decodes"] <= g["mean_tokens"]


def test_scheduler_keeps_the_batch_full_where_the_cache_fits_the_steady_state():
    """The scheduler alone, B_dense 256, 600 requests of 64/64, a cache of 3,400 pages of
    4 tokens: the steady state (128 decodes at a mean context of 96) needs ~3,150 pages,
    the final lengths of as many requests ~4,100. Before the predicted peak and the pace:
    106 requests at once, window 81% full, 419 iterations."""
    out = simulate_report([(64, 64)] * 600, 256, num_pages=3400, page_size=4,
                          max_num_seqs=256, max_model_len=128, admission="predicted")
    st = out["steady_state"]
    assert st["window"] == [65, out["iterations"] - 1 - st["drain_iterations"]]
    assert st["mean_fill"] >= 0.99 and out["preemptions"] == 0
    assert st["max_running"] > 128  # more than the final lengths would have let in
    assert out["iterations"] <= 365


def test_predicted_peak_is_the_most_pages_held_at_once():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, ps = int(rng.integers(1, 20)), int(rng.integers(1, 17))
        now, rem = rng.integers(1, 100, n), rng.integers(1, 60, n)
        brute = max(sum(-(-(now[i] + t) // ps) for i in range(n) if rem[i] >= t)
                    for t in range(1, 61))
        assert predicted_peak(now, rem, ps) == brute


def _queued(sched: Scheduler, n: int) -> None:
    for i in range(n):
        sched.add(Sequence(f"r{i}", [1] * 512, SamplingParams(max_tokens=512, ignore_eos=True)))


def test_pace_is_what_the_cache_can_replace():
    """512/512 requests in 57,600 pages of 16: ~1,188 fit at a mean of 776 tokens, each
    stays 513 iterations: ~2.3 admissions per iteration; a row cap of 1,024 lowers it.
    1,000 requests queued: at their final 1,024 tokens they would need 64,000 pages at
    once, so admission paces."""
    from nanojax.engine.scheduler import _Room
    for cap, want in ((4096, 57600 * 16 / 776 / 513), (1024, 1024 / 513)):
        sched = Scheduler(PageAllocator(57600), 16, 2048, cap, 1024, admission="predicted")
        _queued(sched, 1000)
        assert not _Room(sched).all_fit(sched)
        sched.schedule()  # credit: 1 (idle) + the pace, not the 4 the budget holds
        assert len(sched.running) == int(1 + want) < 4
        assert _Room(sched).pace(sched, sched.waiting[0]) == pytest.approx(want, rel=1e-3)


def test_a_burst_that_fits_at_once_is_not_paced():
    """128 requests of 512/512 where the cache holds them all (Mixtral on the H200: 16,660
    pages, 128 rows): each iteration admits what its token budget holds (4 prompts of 512
    at B_dense 2048), so the run is 32 prefill iterations and the decodes, ~545 in all;
    paced at 128 / 513 a iteration it took 1,020 (bench/results/log/moe.md)."""
    from nanojax.engine.scheduler import _Room
    sched = Scheduler(PageAllocator(16660), 16, 2048, 128, 1024, admission="predicted")
    _queued(sched, 128)
    assert _Room(sched).all_fit(sched)
    sched.schedule()
    assert len(sched.running) == 4
    small = Scheduler(PageAllocator(8000), 16, 2048, 128, 1024, admission="predicted")
    _queued(small, 128)  # the same burst in 8,000 pages: 128 x 64 at the end do not fit
    assert not _Room(small).all_fit(small)
    out = simulate_report([(512, 512)] * 128, 2048, num_pages=16660, page_size=16,
                          max_num_seqs=128, max_model_len=1024, admission="predicted")
    assert out["iterations"] <= 32 + 512 + 2 and out["preemptions"] == 0


def _records(fills, waiting, b_dense=10):
    return [IterationRecord(int(f * b_dense), 0, w, 5, 0, 0.001, 0.0, float(i + 1))
            for i, (f, w) in enumerate(zip(fills, waiting))]


def test_a_stopped_runs_window_is_timed_to_its_last_read_iteration():
    """A run stopped by --time-limit ends with the queue still full, its last launched
    iterations never read (done_t None): the window is still timed, to the last one
    read (the H100 A/B's stopped rows had no rate, fp8.md §91)."""
    fills, waiting = [1.0] * 8, [5] * 8
    recs = _records(fills, waiting)
    for r in recs[6:]:
        r.done_t = None
    st = steady_state(recs, 10, mean_stay=3.0, shape_of=lambda n: 16)
    assert st["window"] == [3, 7] and st["window_tokens"] == 50  # every launched one
    assert st["window_s"] == pytest.approx(6.0 - 3.0)  # iterations 3-5, read at 4, 5, 6
    assert st["tokens_per_s"] == pytest.approx(30 / 3.0) and st["timed_iterations"] == 3
    assert st["by_shape"]["16"]["iterations"] == 3


def test_steady_window_is_between_ramp_up_and_drain():
    fills = [1.0] * 3 + [0.5, 1.0, 0.8, 1.0] + [0.3] * 3
    waiting = [5] * 6 + [0] + [3] + [0] * 2  # the queue last had requests at iteration 7
    st = steady_state(_records(fills, waiting), 10, mean_stay=3.2)
    assert st["ramp_iterations"] == 3 and st["window"] == [3, 7]
    assert st["drain_iterations"] == 2
    assert st["window_tokens"] == 5 + 10 + 8 + 10 + 3
    assert st["mean_fill"] == pytest.approx(36 / 50)
    assert st["window_s"] == pytest.approx(8.0 - 3.0)  # iteration 7 read minus iteration 2
    assert st["full_iteration_share"] == pytest.approx(2 / 5)
    assert st["iteration_ms"]["p50"] == 1000 and st["iteration_ms"]["stalls"] == 0
    recs = _records(fills, waiting)
    for r in recs[5:]:        # iteration 5 took 3 s: one stall of 2 s over 5 iterations
        r.done_t += 2.0
    stalled = steady_state(recs, 10, mean_stay=3.2)
    spread = stalled["iteration_ms"]
    assert spread["max"] == 3000 and spread["stalls"] == 1
    assert spread["stall_ms_per_iteration"] == pytest.approx(2000 / 5)
    # the stall cut to the median: the window's rate as without it
    assert stalled["tokens_per_s"] == pytest.approx(36 / 7)
    assert stalled["tokens_per_s_without_stalls"] == pytest.approx(36 / 5)
    assert st["tokens_per_s_without_stalls"] == pytest.approx(st["tokens_per_s"])
    none = steady_state(_records([1.0] * 4, [2, 0, 0, 0]), 10, mean_stay=3)
    assert none["window"] is None and "never saturated" in none["why_no_window"]


def test_bench_schedule_cli_writes_the_report(tmp_path, capsys):
    import json

    from nanojax.cli import main
    out = tmp_path / "s.json"
    assert main(["bench", "schedule", "--b-dense", "64", "--num-pages", "480", "--page-size",
                 "4", "--input-len", "32", "--output-len", "32", "--num-prompts", "150",
                 "--max-model-len", "64", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["requests"] == 150 and rep["steady_state"]["mean_fill"] >= 0.9
    assert rep["workload"]["input_len"] == 32
    assert main(["bench", "schedule", "--num-pages", "2", "--input-len", "8", "--output-len",
                 "8"]) == 2
    assert "cannot hold one request" in capsys.readouterr().err


def test_merge_splits_the_ratio_into_fill_and_iteration_speed():
    """engine / step = the window's fill x the step's time over an engine iteration's."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "merge_steady_state",
        Path(__file__).parents[1] / "bench" / "repro" / "engine_host" / "merge_steady_state.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)
    step = {"command": "step", "results": [{"b_dense": 2048, "workload": "512/512",
                                            "mode": "non-overlap", "step_s": 0.09,
                                            "tokens_per_s": 2048 / 0.09}]}
    st = {"definition": "d", "window": [513, 1500], "mean_fill": 0.95,
          "s_per_iteration": 0.1, "tokens_per_s": 0.95 * 2048 / 0.1,
          "host_ms_per_iteration": 20.0, "device_wait_share": 0.7, "preemptions": 0}
    engine = {"command": "engine", "results": {"async": {"steady_state": st}}}
    out = merge.merge(step, engine)
    assert out["ratio"] == pytest.approx(0.95 * 0.9)
    assert out["where_the_rest_goes"]["fill_times_speed"] == pytest.approx(out["ratio"])
    assert out["target"] == {"ratio_at_least_0.97": False, "fill_at_least_0.9": True}


def test_engine_timeline_window_profiles_iterations_mid_run(tiny_bundle, tmp_path):
    """`nanojax bench --timeline`: a few iterations from the N-th run under the profiler;
    the run's tokens are those of a run without it, and the report says how busy the
    device was through them (the question of bench/results/log/engine_host.md)."""
    import json

    from nanojax.bench.offline import TimelineWindow, run_offline
    from nanojax.bench.workload import make_requests
    cfg = EngineConfig(b_dense=32, page_size=4, num_pages=128, max_model_len=32,
                       fixed_shapes=True)
    reqs = make_requests(12, tiny_bundle.config.vocab_size, 16, 8, seed=2)
    plain = run_offline(LLMEngine(tiny_bundle, cfg), reqs, progress=False)
    path = tmp_path / "engine.events.json"
    r = run_offline(LLMEngine(tiny_bundle, cfg), reqs, progress=False,
                    timeline=TimelineWindow(str(path), at=3, iterations=2))
    assert r["output_digests"] == plain["output_digests"]
    assert r["iterations"] == plain["iterations"]
    assert len(r["gc"]["runs_by_generation"]) == 3 and r["gc"]["max_pause_ms"] >= 0
    tl = r["timeline"]
    assert tl["first_iteration"] == 3 and tl["iterations"] == 2
    events = json.loads(path.read_text())["engine"]
    assert events and tl["span_us"] > 0 and 0 < tl["busy_fraction_any"] <= 1
    # the raw trace is kept, with the engine's host phases for
    # bench/repro/engine_host/engine_host_timeline.py (and no per-call Python events)
    import gzip
    raw = json.load(gzip.open(tl["raw_trace"]))["traceEvents"]
    names = [e["name"] for e in raw if e.get("ph") == "X"]
    assert names.count("nanojax.launch") == 2 and names.count("nanojax.to_host") == 2
    assert not any(n.startswith("$") for n in names)


def test_a_stopped_run_reports_what_it_measured(tiny_bundle):
    """SIGTERM (a `timeout` around the benchmark) mid-run: the run stops between
    iterations and still reports, marked incomplete, counting the unfinished requests'
    tokens; the process lives on (the handler is the benchmark's, then restored)."""
    import os
    import signal

    from nanojax.bench.offline import run_offline
    from nanojax.bench.workload import StructuredWorkload, make_requests
    eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, page_size=4, num_pages=256,
                                              max_model_len=48, fixed_shapes=True))
    reqs = make_requests(24, tiny_bundle.config.vocab_size, 16, 24, seed=3)
    step, calls = eng.step, []

    def step_then_term():
        calls.append(1)
        if len(calls) == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return step()

    eng.step = step_then_term
    before = signal.getsignal(signal.SIGTERM)
    # (the CLI always passes a structured workload, constraining none by default)
    r = run_offline(eng, reqs, progress=False, structured=StructuredWorkload(0.0))
    assert signal.getsignal(signal.SIGTERM) == before
    assert r["complete"] is False and r["iterations"] in (12, 13)
    assert r["finished_requests"] < r["requests"] == 24
    produced = sum(len(s.output_ids) for s in eng.requests.values())
    assert r["output_tokens"] >= produced > 0
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    ended = r["structured"]["finish_reasons"]["unconstrained"]
    assert ended["unfinished"] == 24 - r["finished_requests"] > 0
    done = run_offline(LLMEngine(tiny_bundle, EngineConfig(
        b_dense=32, page_size=4, num_pages=256, max_model_len=48, fixed_shapes=True)),
        reqs, progress=False, time_limit=600)
    assert done["complete"] is True and done["finished_requests"] == 24
    assert done["output_tokens"] == 24 * 24


def test_launch_summary_pads_each_iteration_to_the_engines_bucket():
    """The simulations' tokens launched: each iteration at the smallest compiled shape
    that holds it, which is the engine's own padding (runner.bucket) for those shapes."""
    from nanojax.bench.schedule_sim import launch_summary, simulate
    from nanojax.engine.runner import bucket
    shapes = (16, 32, 64, 96, 128)  # steps of 32 above 32 at B_dense 128
    recs, sched = simulate([(70, 20)] * 40, 128, num_pages=400, page_size=16,
                           max_num_seqs=24, max_model_len=96, step_shapes=shapes)
    run = launch_summary(recs, sched, shapes)
    padded = [bucket(r.tokens, 16, 128, 32) for r in recs]
    # a request's tokens through the model: its prompt and every output but the last
    assert run["iterations"] == len(recs) and run["real_tokens"] == 40 * (70 + 19)
    assert run["launched_tokens"] == sum(padded) > run["real_tokens"]
    assert run["launched_by_shape"] == {s: padded.count(s) for s in shapes if s in padded}
    assert 96 in run["launched_by_shape"]  # a step between powers of two ran
