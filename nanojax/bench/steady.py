"""The steady-state report of an offline run: how full the dense batches were once the
engine was saturated, and where the time went there.

Steady window (STEADY_WINDOW below, recorded with every report): the iterations from the
end of the ramp-up to the last iteration that left requests waiting.
- Ramp-up: the first W iterations, W = the mean stay of a request in iterations (one per
  output token, plus one for its prompt). The running set starts empty; by Little's law
  it takes about one mean stay to fill it and to see requests finish and be replaced.
- Drain: every iteration after the last one scheduled while requests were still waiting.
  From then on nothing is left to fill the batch with, and it empties.
Inside the window there was always more work than the batch held, so a batch that was not
full is the scheduler's doing (or the KV cache's, or the row cap's), not the workload's.
Tokens are every token of the launched batches (prompt chunks, recomputed ones included,
and decode inputs), as the step benchmark counts a dense batch.
"""
from __future__ import annotations

from collections.abc import Callable

STEADY_WINDOW = (
    "iterations from the end of the ramp-up (the first W iterations, W = a request's mean "
    "stay: its mean output tokens + 1) to the last iteration that left requests waiting "
    "(the drain follows); tokens are every token of the launched batches")


def steady_state(records: list, b_dense: int, mean_stay: float,
                 shape_of: Callable[[int], int] | None = None) -> dict:
    """records: one IterationRecord per launched iteration, in order (done_t: when its
    tokens were read; None in a simulation without a clock, which leaves out the times).
    mean_stay: a request's mean stay in iterations (mean output tokens + 1). shape_of:
    the token count a step of n tokens is padded to (the engine's bucket): the window's
    iteration times are then also given per shape ("by_shape"), and a stall is an
    iteration slower than its own shape's median, not a long shape among short ones."""
    n = len(records)
    ramp = min(n, max(1, round(mean_stay)))
    waiting = [i for i, r in enumerate(records) if r.waiting > 0]
    end = waiting[-1] if waiting else -1
    out = {"definition": STEADY_WINDOW, "ramp_iterations": ramp,
           "drain_iterations": n - 1 - end if end >= 0 else n,
           "ramp_mean_fill": _fill(records[:ramp], b_dense),
           "drain_mean_fill": _fill(records[end + 1:], b_dense),
           "max_running": max((r.running for r in records), default=0)}
    if end < ramp:
        out["window"] = None
        out["why_no_window"] = ("the queue emptied before the ramp-up ended: the workload "
                                "never saturated the engine (give more requests)")
        return out
    win = records[ramp:end + 1]
    tokens = sum(r.tokens for r in win)
    out.update({
        "window": [ramp, end],
        "window_iterations": len(win),
        "window_tokens": tokens,
        "total_tokens": sum(r.tokens for r in records),
        "mean_fill": tokens / (len(win) * b_dense),
        # iterations at least 99% full: a few half-empty ones or many slightly short ones
        "full_iteration_share": sum(r.tokens >= 0.99 * b_dense for r in win) / len(win),
        "mean_decodes": sum(r.decodes for r in win) / len(win),
        "mean_running": sum(r.running for r in win) / len(win),
        "preemptions": win[-1].preemptions - records[ramp - 1].preemptions,
        "host_ms_per_iteration": 1e3 * sum(r.host_s for r in win) / len(win),
        # of it, dispatching the step (and page loads): large only if a dispatch blocks
        "launch_ms_per_iteration": 1e3 * sum(r.launch_s for r in win)
        / len(win),
        # of that, building the step's host arrays (the rest: dispatch and transfers)
        "inputs_ms_per_iteration": 1e3 * sum(r.inputs_s for r in win) / len(win),
        # forming the batch, and turning the step before's tokens into outputs
        "schedule_ms_per_iteration": 1e3 * sum(r.schedule_s for r in win) / len(win),
        "process_ms_per_iteration": 1e3 * sum(r.process_s for r in win) / len(win),
    })
    before = records[ramp - 1].done_t
    # a stopped run's last launched iterations were never read: time the window to the
    # last one that was
    timed = len(win)
    while timed and win[timed - 1].done_t is None:
        timed -= 1
    if before is not None and timed:
        win = win[:timed]
        tokens = sum(r.tokens for r in win)
        secs = win[-1].done_t - before
        out.update({
            "timed_iterations": timed,  # of window_iterations (a stopped run's are fewer)
            "window_s": secs,
            "tokens_per_s": tokens / secs,
            "s_per_iteration": secs / len(win),
            # what the window's iteration rate gives with every batch full: the gap to
            # tokens_per_s is the fill's, the gap to the step benchmark the iteration's
            "tokens_per_s_at_full_fill": b_dense * len(win) / secs,
            "device_wait_share": sum(r.wait_s for r in win) / secs,
            "iteration_ms": _intervals([records[ramp - 1].done_t] + [r.done_t for r in win],
                                       [shape_of(r.tokens) for r in win] if shape_of else None),
        })
        if shape_of is not None:
            out["by_shape"] = _by_shape(records[ramp - 1:ramp + timed], shape_of)
        # the window's rate with each stall cut to the median iteration: a profiler's start
        # or a collector's pause inside the window costs what this gap says, no more
        stalled = out["iteration_ms"].get("stall_ms_per_iteration", 0.0) * len(win) / 1e3
        if stalled < secs:
            out["tokens_per_s_without_stalls"] = tokens / (secs - stalled)
    return out


def _intervals(done: list, shapes: list | None = None) -> dict:
    """The spread of the window's iteration times (between successive token reads): does
    the window lose its time evenly, or in a few stalls? stall_ms_per_iteration: the time
    above 1.25x the median (of the iteration's own shape, where shapes are given), summed
    and spread over the window."""
    ms = [1e3 * (b - a) for a, b in zip(done, done[1:])]
    if not ms:
        return {}
    shapes = shapes or [0] * len(ms)
    median = {k: _median([x for x, s in zip(ms, shapes) if s == k]) for k in set(shapes)}
    over = [x - median[s] for x, s in zip(ms, shapes) if x > 1.25 * median[s]]
    ms = sorted(ms)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"p50": _median(ms), "p90": pick(0.9), "p99": pick(0.99), "max": ms[-1],
            "stalls": len(over), "stall_ms_per_iteration": sum(over) / len(ms)}


def _by_shape(records: list, shape_of: Callable[[int], int]) -> dict:
    """Per step shape (padded token count) of records[1:] (records[0]: the one before
    the window, for its end time): iterations, their mean real tokens and decodes, and
    the median and mean time between token reads: what a shape costs, padding included."""
    groups: dict[int, list] = {}
    for before, r in zip(records, records[1:]):
        groups.setdefault(shape_of(r.tokens), []).append((r, 1e3 * (r.done_t - before.done_t)))
    return {str(shape): {"iterations": len(g),
                         "mean_tokens": sum(r.tokens for r, _ in g) / len(g),
                         "mean_decodes": sum(r.decodes for r, _ in g) / len(g),
                         "p50_ms": _median([ms for _, ms in g]),
                         "mean_ms": sum(ms for _, ms in g) / len(g)}
            for shape, g in sorted(groups.items())}


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _fill(records: list, b_dense: int) -> float | None:
    return sum(r.tokens for r in records) / (len(records) * b_dense) if records else None
