"""Same batches before and after (issue 43: the schedule phase on arrays): the base
scheduler (nanojax/engine/scheduler.py at BASE_REV, schedule_ab.py's) and this tree's run
in lockstep over each workload, each iteration's batch read back as the engine does (async
scheduling: iteration i+1 formed before i's tokens are read), and after every iteration
they must agree on everything the scheduler decides: each entry (request, start, tokens,
samples, the row its input comes from), the decodes, the preemptions, every running
request's pages, computed and cached pages, the queue's order, the free pages, the credit.
Workloads: 128/128, sharegpt and 512/512 at the H200's sizes (B_dense 2048, 53,000 pages,
1,152 rows); then small caches (preemptions), early stops, chunk cuts, a prefill cap, aborts,
steps read at once, and the prefix cache (hits, evictions). (No times: the two allocate
into one heap, so each pays for the other's garbage collections; schedule_ab.py times them.)
Usage: python bench/repro/engine_host/schedule_lockstep.py OUT.json [BASE_REV] [--quick]"""
import json
import subprocess
import sys

import numpy as np

from schedule_ab import base_scheduler  # (this directory)


def _scheduler(cls, prompts, outs, *, num_pages, ps, b_dense, max_seqs, max_len, admission,
               prefix, max_prefill, cuts, can_stop):
    from nanojax.engine.kv_cache import PageAllocator
    from nanojax.engine.prefix_cache import PrefixCache
    from nanojax.engine.sampling import SamplingParams
    from nanojax.engine.sequence import Sequence
    alloc = PageAllocator(num_pages)
    s = cls(alloc, ps, b_dense, max_seqs, max_len, chunk_cuts=cuts, admission=admission,
            prefix_cache=PrefixCache(alloc, ps, b"root") if prefix else None,
            max_prefill_seqs=max_prefill)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        s.add(Sequence(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=not can_stop,
                                                  temperature=0)))
    return s


def _read(sched, batch, stops: dict) -> int:
    """The engine's reading of a batch: a token per sampling entry (the same in both);
    returns how many requests finished."""
    from nanojax.bench.schedule_sim import read_tokens
    return read_tokens(
        sched, batch, token=lambda seq: (len(seq.output_ids) * 7 + int(seq.request_id[1:])) % 50,
        stop=lambda seq: len(seq.output_ids) == stops.get(seq.request_id))


def _state(sched, batch) -> tuple:
    return ([(e.seq.request_id, e.start, e.num_tokens, e.samples, e.prev_row)
             for e in batch.entries], batch.num_decodes, batch.num_tokens,
            sched.num_preemptions,
            [(s.request_id, tuple(s.pages), s.num_computed, s.num_cached_pages)
             for s in sched.running], [s.request_id for s in sched.waiting],
            sched.allocator.num_free, sched._credit)


def lockstep(name, base_cls, prompts, outs, stops=None, read_now_every=0, abort_every=0,
             num_pages=53000, ps=16, b_dense=2048, max_seqs=1152, max_len=2048,
             admission="predicted", prefix=False, max_prefill=None, cuts=(),
             can_stop=False) -> dict:
    from nanojax.engine.scheduler import Scheduler
    kw = dict(num_pages=num_pages, ps=ps, b_dense=b_dense, max_seqs=max_seqs, max_len=max_len,
              admission=admission, prefix=prefix, max_prefill=max_prefill, cuts=tuple(cuts),
              can_stop=can_stop)
    scheds = {"base": _scheduler(base_cls, prompts, outs, **kw),
              "new": _scheduler(Scheduler, prompts, outs, **kw)}
    stops = stops or {}
    flight = {"base": None, "new": None}
    left, it, decodes, aborts = len(prompts), 0, 0, 0
    while left:
        it += 1
        batch = {}
        for v, s in scheds.items():
            batch[v] = s.schedule(flight[v])
        a, b = (_state(scheds[v], batch[v]) for v in ("base", "new"))
        if a != b:
            field = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return {"workload": name, "identical": False, "iteration": it,
                    "field": field, "base": str(a[field])[:2000], "new": str(b[field])[:2000]}
        if not batch["base"] and flight["base"] is None:
            raise RuntimeError(f"{name}: stalled with {left} requests left")
        decodes += batch["base"].num_decodes
        for v, s in scheds.items():
            done = _read(s, flight[v], stops) if flight[v] is not None else 0
            if read_now_every and it % read_now_every == 0 and batch[v]:
                done += _read(s, batch[v], stops)  # a step read at once (no async)
                batch[v] = None
            if abort_every and it % abort_every == 0 and s.running:
                seq = s.running[len(s.running) // 2]  # the same request in both
                seq.finish("abort")
                s.remove(seq)
                done += 1
                aborts += v == "base"
            flight[v] = batch[v] or None
        left -= done  # (the same in both, as their batches are)
    return {"workload": name, "identical": True, "iterations": it, "decodes": decodes,
            "preemptions": scheds["base"].num_preemptions, "aborts": aborts}


def _lengths(n, inp, out, trace, max_len):
    from nanojax.bench.workload import make_requests
    reqs = make_requests(n, 2, inp, out, trace, max_len, 0)
    return [r.prompt_ids for r in reqs], [r.output_len for r in reqs]


def main(path: str, rev: str = "HEAD", *flags: str):
    quick = "--quick" in flags
    base = base_scheduler(rev)
    rng = np.random.default_rng(1)
    runs = [
        ("128/128", *_lengths(600 if quick else 4096, 128, 128, None, 1024), {"max_len": 1024}),
        ("sharegpt", *_lengths(600 if quick else 4096, 0, 0, "sharegpt", 2048), {}),
        ("512/512", *_lengths(400 if quick else 3072, 512, 512, None, 1024), {"max_len": 1024}),
        ("greedy, small cache", *_lengths(800, 128, 128, None, 512),
         {"num_pages": 2500, "max_len": 512, "admission": "greedy", "b_dense": 512,
          "max_seqs": 512}),
    ]
    prompts, outs = _lengths(800, 96, 96, None, 512)
    runs.append(("predicted, small cache, stops, cuts, prefill cap, aborts, steps read at once",
                 prompts, outs,
                 {"num_pages": 3000, "max_len": 512, "b_dense": 512, "max_seqs": 512,
                  "can_stop": True, "cuts": (128, 256), "max_prefill": 6, "abort_every": 17,
                  "read_now_every": 5,
                  "stops": {f"r{i}": int(rng.integers(1, 60)) for i in range(0, 800, 3)}}))
    stems = [rng.integers(0, 50, 200).tolist() for _ in range(5)]
    prompts = [stems[i % 5][:int(rng.integers(20, 200))]
               + rng.integers(0, 50, int(rng.integers(1, 60))).tolist() for i in range(800)]
    outs = rng.integers(4, 120, 800).tolist()
    runs.append(("prefix cache, predicted, aborts, steps read at once", prompts, outs,
                 {"num_pages": 1500, "max_len": 512, "b_dense": 512, "max_seqs": 512,
                  "prefix": True, "abort_every": 23, "read_now_every": 7}))
    runs.append(("prefix cache, greedy, small cache, pages of 4", prompts, outs,
                 {"num_pages": 900, "max_len": 512, "b_dense": 256, "max_seqs": 256,
                  "prefix": True, "admission": "greedy", "ps": 4}))
    results = []
    for name, prompts, outs, kw in runs:
        r = lockstep(name, base, prompts, outs, **kw)
        results.append(r)
        print(json.dumps(r), file=sys.stderr)
    from nanojax.profiling.record import run_record
    rec = run_record(None)
    rec["command"] = " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv)
    sha = subprocess.run(["git", "rev-parse", rev], capture_output=True, text=True).stdout
    with open(path, "w") as f:
        json.dump({**rec, "base": f"nanojax/engine/scheduler.py at {rev} ({sha.strip()})",
                   "all_identical": all(r["identical"] for r in results),
                   "results": results}, f, indent=1)
    print("all identical" if all(r["identical"] for r in results) else "DIFFERENT")
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
