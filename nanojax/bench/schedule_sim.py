"""The scheduler without a model: an offline workload through the engine's Scheduler, each
iteration's samples made up on the spot, so the batch fill and the steady-state window of
a configuration the size of a GPU's (B_dense 2048, 50,000 KV pages, thousands of requests)
can be seen on a laptop in seconds. Tokens do not matter to the scheduler, only lengths.

The loop is the engine's (llm_engine.py) with async scheduling: iteration i+1 is formed
before iteration i's tokens are read, and a request that finished in i is retired then.
"""
from __future__ import annotations

import bisect
import time

from nanojax.bench.steady import steady_state
from nanojax.engine.kv_cache import PageAllocator
from nanojax.engine.llm_engine import IterationRecord
from nanojax.engine.sampling import SamplingParams
from nanojax.engine.scheduler import ScheduledBatch, Scheduler
from nanojax.engine.sequence import Sequence


def simulate(lengths: list[tuple[int, int]], b_dense: int, num_pages: int, page_size: int,
             max_num_seqs: int, max_model_len: int, admission: str = "predicted",
             max_prefill_seqs: int | None = None, chunk_cuts: tuple[int, ...] = (),
             step_shapes: tuple[int, ...] = (),
             prefill_spread: int = 0) -> tuple[list[IterationRecord], Scheduler]:
    """Every request [(prompt, output)] queued at once, run to the end; one record per
    iteration (host_s: the scheduler's own time; no device, so no done_t). step_shapes:
    the engine's compiled token counts, for the scheduler's fit to them (none: off);
    prefill_spread: Scheduler.prefill_spread (EngineConfig.prefill_spread)."""
    sched = Scheduler(PageAllocator(num_pages), page_size, b_dense, max_num_seqs,
                      max_model_len, chunk_cuts=chunk_cuts, admission=admission,
                      max_prefill_seqs=max_prefill_seqs)
    sched.step_shapes, sched.prefill_spread = step_shapes, prefill_spread
    for i, (prompt, out) in enumerate(lengths):
        sched.add(Sequence(f"r{i}", [1] * prompt,
                           SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)))
    records: list[IterationRecord] = []
    in_flight: ScheduledBatch | None = None
    left = len(lengths)
    while left:
        t = time.perf_counter()
        batch = sched.schedule(in_flight)  # its rows: the decodes' newest tokens
        host = time.perf_counter() - t
        if batch:
            records.append(IterationRecord(batch.num_tokens, batch.num_decodes,
                                           len(sched.waiting), len(sched.running),
                                           sched.num_preemptions, host))
        if not batch and in_flight is None:
            raise RuntimeError(f"the scheduler stalled with {left} requests left")
        if in_flight is not None:
            left -= read_tokens(sched, in_flight)
        in_flight = batch if batch else None
    return records, sched


def launch_summary(records: list[IterationRecord], sched: Scheduler,
                   shapes: tuple[int, ...]) -> dict:
    """What a simulated run launched with these compiled token counts (ascending): each
    iteration at the smallest that holds it, as the engine pads a step (padding is what the
    GEMMs pay for)."""
    launched = [shapes[bisect.bisect_left(shapes, r.tokens)] for r in records]
    return {"iterations": len(records), "real_tokens": sum(r.tokens for r in records),
            "launched_tokens": sum(launched), "preemptions": sched.num_preemptions,
            "launched_by_shape": {s: launched.count(s) for s in shapes if s in launched}}


def read_tokens(sched: Scheduler, batch: ScheduledBatch, token=lambda seq: 1,
                stop=lambda seq: False) -> int:
    """What the engine's reading of a batch does to the scheduler's requests: token(seq)
    appended for each sampling entry; a request ends at max_tokens or the model's length
    ("length") or where stop(seq) says ("stop"). Returns how many finished."""
    finished = 0
    for e in batch.entries:
        seq = e.seq
        if not e.samples or seq.is_finished:
            continue
        seq.pending -= 1
        seq.output_ids.append(token(seq))
        if len(seq.output_ids) >= seq.params.max_tokens or seq.num_known >= sched.max_model_len:
            seq.finish("length")
        elif stop(seq):
            seq.finish("stop")
        else:
            continue
        sched.remove(seq)
        finished += 1
    return finished


def simulate_report(lengths: list[tuple[int, int]], b_dense: int, **kw) -> dict:
    """simulate() and its steady-state report (steady.py), the whole run's fill beside."""
    t = time.perf_counter()
    records, sched = simulate(lengths, b_dense, **kw)
    mean_stay = sum(o for _, o in lengths) / len(lengths) + 1
    return {"requests": len(lengths), "iterations": len(records),
            "mean_batch_fill": sum(r.tokens for r in records) / (len(records) * b_dense),
            "preemptions": sched.num_preemptions, "simulated_s": time.perf_counter() - t,
            "steady_state": steady_state(records, b_dense, mean_stay)}
