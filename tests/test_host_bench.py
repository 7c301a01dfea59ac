"""A CI guard on the engine's host loop (issue 43, item 2): the host milliseconds an
iteration costs around the stand-in model (nanojax/bench/host.py), divided by a fixed
pure-Python workload timed in the same process, must not grow past a bound. No wall-clock
time is asserted: a slower or busier machine slows both."""
import dataclasses
import json
import subprocess
import sys

import pytest

from nanojax.bench.host import HostBenchConfig, python_reference_ms, run_host_bench

# The measured ratio host_ms_p50 (the steady window's median iteration) /
# python_reference_ms() (the best of 20 runs) of GUARD_CONFIG on the development machine
# (2 cores, CPU only; 2026-12-04): 0.53-0.69 idle, 0.57-0.73 with two busy processes
# beside it (median and best-of: robust to another process's preemptions; means were not,
# nor a reference that allocated). The bound is 2.5x the top of it: a host loop that grew
# that much fails (the loop before issue 43's work measured 2.6x today's), noise does not.
MEASURED_RATIO = 0.73
MAX_RATIO = 2.5 * MEASURED_RATIO

# 200 requests decoding at once (600 queued), short prompts and outputs so the prompts of
# the requests that replace finished ones fit B_dense (400) and the running set stays full
GUARD_CONFIG = HostBenchConfig(running=200, input_len=32, output_len=32)


@pytest.fixture(scope="module")
def guard_run():
    run = run_host_bench(GUARD_CONFIG)
    return run, python_reference_ms()


def test_host_loop_stays_within_its_ratio_of_the_python_reference(guard_run):
    run, ref = guard_run
    assert run["window_iterations"] and run["window_iterations"] >= 30, \
        "no steady window: the benchmark never saturated the engine"
    # the window measured what it claims: the running set full, not a ramp or a drain
    assert run["mean_running"] >= 0.9 * GUARD_CONFIG.running
    ratio = run["host_ms_p50"] / ref
    print(f"host {run['host_ms_p50']:.3f} ms/iteration (median), reference {ref:.2f} ms, "
          f"ratio {ratio:.4f} (bound {MAX_RATIO:.4f})")
    assert ratio < MAX_RATIO, (
        f"the engine's host loop costs {ratio:.4f}x the Python reference an iteration "
        f"(measured {MEASURED_RATIO} on {GUARD_CONFIG}); see `nanojax bench host "
        f"--profile PATH` for where it went")


def test_host_phases_are_reported(guard_run):
    run, _ = guard_run
    fields = ("host_ms_per_iteration", "schedule_ms_per_iteration",
              "launch_ms_per_iteration", "inputs_ms_per_iteration",
              "process_ms_per_iteration", "s_per_iteration", "device_wait_share",
              "mean_fill", "mean_running")
    for f in fields:
        assert isinstance(run[f], float) and run[f] >= 0, f
    host = run["host_ms_per_iteration"]
    # (process_ms is host less schedule and launch by definition: no sum to check)
    assert run["schedule_ms_per_iteration"] + run["launch_ms_per_iteration"] < host
    assert all(run[f] > 0 for f in ("schedule_ms_per_iteration",
                                    "launch_ms_per_iteration", "process_ms_per_iteration"))
    assert run["inputs_ms_per_iteration"] <= run["launch_ms_per_iteration"]  # a part of it
    # the host's share of an iteration: with no device work, most of it
    assert host <= 1e3 * run["s_per_iteration"] * 1.05
    assert run["config"] == dataclasses.asdict(GUARD_CONFIG) and run["iterations"] > 0


def test_python_reference_is_a_positive_time():
    ms = python_reference_ms(n=5_000)
    assert 0 < ms < 1e4


def test_cli_writes_the_runs(tmp_path):
    path = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, "-m", "nanojax", "bench", "host", "--running",
                           "100", "--output-len", "16", "--json", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["python_reference_ms"] > 0
    (run,) = data["runs"]
    assert run["config"]["running"] == 100 and run["config"]["output_len"] == 16
    assert run["host_ms_per_iteration"] > 0 and run["window_iterations"] > 0
    assert "running 100: host" in proc.stderr


def test_constrained_requests_run_their_grammar_with_masks_off_the_engine_thread():
    """--structured-fraction: every request under the benchmark's JSON schema (grammars
    against SmolLM2's tokenizer, the stand-in's vocabulary widened to it), steps
    dispatched from the runner's thread: the masks are filled there (timed), and every
    request runs to its length under its grammar."""
    pytest.importorskip("llguidance")
    run = run_host_bench(HostBenchConfig(running=16, input_len=8, output_len=8,
                                         structured_fraction=1.0, async_dispatch=True))
    assert run["async_dispatch"] is True and run["mask_fill_ms"] > 0
    assert run["finish_reasons"] == {"length": 48}
