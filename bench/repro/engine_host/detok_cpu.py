"""The engine's per-token detokenization on the host (issue 43: no Python objects per token
on the hot path): IncrementalDetokenizer.push for 1,000 running requests, one token each per
iteration, with tokenizers' DecodeStream against the two-window decode it replaced;
interleaved, median over 64 iterations, SmolLM2's tokenizer, random ids.
Usage: python bench/repro/engine_host/detok_cpu.py OUT.json"""
import json
import statistics
import sys
import time

import numpy as np


def per_iteration_ms(tok, ids, stream: bool) -> tuple[float, list[str]]:
    from nanojax import tokenizer as tokenizer_mod
    make = tokenizer_mod._decode_stream
    if not stream:
        tokenizer_mod._decode_stream = lambda: None
    try:
        dets = [tokenizer_mod.IncrementalDetokenizer(tok) for _ in range(len(ids))]
    finally:
        tokenizer_mod._decode_stream = make
    times = []
    for step in range(ids.shape[1]):
        t = time.perf_counter()
        for d, tok_id in zip(dets, ids[:, step].tolist()):
            d.push([tok_id])
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times), [d.text for d in dets]


def main(path: str) -> int:
    from nanojax.bench.workload import load_tokenizer
    from nanojax.profiling.record import run_record
    tok = load_tokenizer("smollm2-135m")
    ids = np.random.default_rng(0).integers(100, 40_000, (1000, 64))
    rows = []
    for rep in range(3):
        for stream in (False, True):
            ms, texts = per_iteration_ms(tok, ids, stream)
            rows.append({"decode_stream": stream, "repeat": rep, "ms_per_iteration": ms})
            print(rows[-1], file=sys.stderr)
    best = {s: min(r["ms_per_iteration"] for r in rows if r["decode_stream"] is s)
            for s in (False, True)}
    out = {**run_record(None), "argv": sys.argv, "requests": 1000, "iterations": 64,
           "rows": rows, "best_ms": {"window": best[False], "decode_stream": best[True]},
           "stream_over_window": best[True] / best[False]}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["best_ms"]), out["stream_over_window"])
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
