"""The tokens a step launches, padding included, with the GPU's token buckets (powers of
two up to B_dense) against buckets in steps of 256 or 128 above that step
(EngineConfig.token_bucket_step), on TensorRT-LLM's four rows at the H100's and the
H200's FP8 KV caches: the scheduler alone (nanojax/bench/schedule_sim.py), its fit to the
compiled shapes on, no model, so no times: launched tokens are what the GEMMs pay for; how
that turns into seconds needs the GPU (bench/repro/fp8/engine_h200.sh
EXTRA="--token-bucket-step 256"). Each row at the engine's own sizes: max_model_len
prompt + output, the decode batch the cache holds at half of it (kv_cache.size_cache),
B_dense 2048, pages of 16, predicted admission, 64 prefilling requests at most.
--spread 0,4,8: steps of 256 with the prompts spread over that many steps
(EngineConfig.prefill_spread) instead of the steps' sweep.
Usage: python bench/repro/engine_host/bucket_step_sim.py OUT.json [--spread 0,4,8]"""
import json
import sys

from nanojax.bench.schedule_sim import launch_summary, simulate
from nanojax.engine.runner import bucket

B_DENSE, PAGE, MIN_BUCKET = 2048, 16, 16
CACHES = {"h100": 57009, "h200": 107292}  # FP8 pages at 0.9 of the card (fp8.md §91, §86)
ROWS = [(128, 128, 8192), (500, 2000, 3000), (1000, 1000, 3000), (2048, 2048, 1500)]
STEPS = (None, 256, 128)  # None: powers of two (the GPU default before fp8.md §94)


def buckets(step: int | None) -> tuple[int, ...]:
    out = [bucket(1, MIN_BUCKET, B_DENSE, step)]
    while out[-1] < B_DENSE:
        out.append(bucket(out[-1] + 1, MIN_BUCKET, B_DENSE, step))
    return tuple(out)


def main(out_path: str, spreads: list[int] | None = None) -> None:
    # (step, prefill_spread) runs: the steps' sweep without spreading, or steps of 256
    # (the GPU default) at each spread
    runs = [(step, 0) for step in STEPS] if spreads is None else [(256, s) for s in spreads]
    out = {"b_dense": B_DENSE, "page_size": PAGE, "admission": "predicted",
           "max_prefill_seqs": 64, "fit_step_shapes": True, "rows": []}
    for card, pages in CACHES.items():
        for prompt, output, n in ROWS:
            max_len = prompt + output
            rows = min(B_DENSE, pages * PAGE // (max_len // 2))
            row = {"card": card, "row": f"{prompt}/{output}", "requests": n, "pages": pages,
                   "max_model_len": max_len, "max_num_seqs": rows, "by_step": {}}
            for step, spread in runs:
                shapes = buckets(step)
                recs, sched = simulate([(prompt, output)] * n, B_DENSE, num_pages=pages,
                                       page_size=PAGE, max_num_seqs=rows,
                                       max_model_len=max_len, admission="predicted",
                                       max_prefill_seqs=64, step_shapes=shapes,
                                       prefill_spread=spread)
                run = launch_summary(recs, sched, shapes)
                ratio = run["launched_tokens"] / run["real_tokens"]
                key = str(step) if spreads is None else f"256/spread {spread}"
                row["by_step"][key] = {"token_buckets": shapes, "prefill_spread": spread,
                                       **run, "launched_over_real": ratio}
                print(card, row["row"], rows, key, len(recs), f"{ratio:.3f}", flush=True)
            out["rows"].append(row)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    spread = sys.argv[3] if len(sys.argv) == 4 and sys.argv[2] == "--spread" else None
    if len(sys.argv) not in (2, 4) or (len(sys.argv) == 4 and spread is None):
        sys.exit(__doc__.splitlines()[-1])
    main(sys.argv[1], None if spread is None else [int(x) for x in spread.split(",")])
