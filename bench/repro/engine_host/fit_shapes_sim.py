"""The tokens a step launches, padding included, with and without the scheduler's fit to
the compiled shapes (EngineConfig.fit_step_shapes), on TensorRT-LLM's four rows at the
sizes the GPU runs had: the scheduler alone (nanojax/bench/schedule_sim.py), no model, so
no times: launched tokens are what the GEMMs pay for; how that turns into seconds needs
the GPU (bench/repro/fp8/engine_h200.sh AB="--no-fit-step-shapes").
Rows: 1000/1000 at the H100's 57,009 FP8 pages (445 rows: its GPU run launched 7,746
iterations), and each row at the H200's 107,292 (2,048 rows); B_dense 2048, pages of 16,
predicted admission, 64 prefilling requests at most, the GPU's token counts (16 ... 2,048).
Usage: python bench/repro/engine_host/fit_shapes_sim.py OUT.json"""
import json
import sys

from nanojax.bench.schedule_sim import launch_summary, simulate

SHAPES = tuple(1 << i for i in range(4, 12))  # the GPU's token buckets at B_dense 2048
ROWS = [  # (prompt, output, requests, pages, rows)
    (1000, 1000, 3000, 57009, 445),
    (128, 128, 8192, 107292, 2048),
    (1000, 1000, 3000, 107292, 2048),
    (500, 2000, 3000, 107292, 2048),
    (2048, 2048, 1500, 107292, 2048),
]


def main(out_path: str) -> None:
    out = {"shapes": SHAPES, "b_dense": 2048, "page_size": 16, "admission": "predicted",
           "max_prefill_seqs": 64, "rows": []}
    for prompt, output, n, pages, rows in ROWS:
        row = {"row": f"{prompt}/{output}", "requests": n, "pages": pages, "max_num_seqs": rows}
        for fit in (False, True):
            recs, sched = simulate([(prompt, output)] * n, 2048, num_pages=pages, page_size=16,
                                   max_num_seqs=rows, max_model_len=4096,
                                   admission="predicted", max_prefill_seqs=64,
                                   step_shapes=SHAPES if fit else ())
            row["fit" if fit else "no_fit"] = launch_summary(recs, sched, SHAPES)
        row["launched_fit_over_no_fit"] = (row["fit"]["launched_tokens"]
                                           / row["no_fit"]["launched_tokens"])
        print(row["row"], pages, {k: row[k]["launched_tokens"] for k in ("no_fit", "fit")},
              f"{row['launched_fit_over_no_fit']:.3f}", flush=True)
        out["rows"].append(row)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
