"""How many requests run at once on 1000/1000 at the H100's FP8 cache (57,009 pages of 16),
with the decode cap the GPU runs had (max_num_seqs 445: the cache over max_model_len 4096 /
2, EngineConfig's default from MAX_LEN=4096) and without one (2,048: B_dense, predicted
admission alone guarding the cache), each with the GPU's token counts (powers of two) and
with a 1,536 among them (--token-bucket-step 512): the scheduler alone
(nanojax/bench/schedule_sim.py), no model, so iterations, decodes and the shapes launched,
not seconds. B_dense 2048, predicted admission, 64 prefilling requests at most, the fit
to the compiled token counts.
Usage: python bench/repro/engine_host/decode_cap_sim.py OUT.json"""
import json
import sys

from nanojax.bench.schedule_sim import launch_summary, simulate

POWERS = tuple(1 << i for i in range(4, 12))  # the GPU's token buckets at B_dense 2048
STEPS = {None: POWERS, 512: POWERS[:-1] + (1536, 2048)}  # --token-bucket-step: the buckets
PROMPT, OUTPUT, REQUESTS, PAGES = 1000, 1000, 3000, 57009


def main(out_path: str) -> None:
    out = {"row": f"{PROMPT}/{OUTPUT}", "requests": REQUESTS, "pages": PAGES, "page_size": 16,
           "b_dense": 2048, "admission": "predicted", "max_prefill_seqs": 64,
           "max_model_len": 4096, "runs": []}
    for step, shapes in STEPS.items():
        for cap in (445, 2048):
            recs, sched = simulate([(PROMPT, OUTPUT)] * REQUESTS, 2048, num_pages=PAGES,
                                   page_size=16, max_num_seqs=cap, max_model_len=4096,
                                   admission="predicted", max_prefill_seqs=64,
                                   step_shapes=shapes)
            run = {"max_num_seqs": cap, "token_bucket_step": step,
                   **launch_summary(recs, sched, shapes),
                   "mean_decodes": sum(r.decodes for r in recs) / len(recs),
                   "max_running": max(r.running for r in recs)}
            print(run, flush=True)
            out["runs"].append(run)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
