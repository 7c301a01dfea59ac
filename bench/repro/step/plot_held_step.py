"""Bars of the step held back to back (`nanojax bench step --sustain-seconds`), one group
per workload, one bar per mode, each labelled with the board power and SM clock it ran at
(bench/results/log/step.md §66: at the H200's power cap a faster kernel lowers the clock
for the rest).

    python3 bench/repro/step/plot_held_step.py STEP.json --out held.png
"""
from __future__ import annotations

import argparse
import json
import sys


def held_rows(record: dict) -> list[dict]:
    """(workload, mode, held ms, W, MHz, fraction of optimal) of the results that were held."""
    rows = []
    for r in record.get("results", []):
        s = r.get("sustained")
        if not s:
            continue
        p = s.get("power") or {}
        rows.append({"workload": r["workload"], "mode": r["mode"], "ms": 1e3 * s["step_s"],
                     "watts": p.get("power_w_mean"), "mhz": p.get("sm_clock_mhz_mean"),
                     "of_optimal": s.get("fraction_of_optimal")})
    return rows


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["workload"], r["mode"]): r for r in rows}
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(3 + 2.6 * len(workloads), 4.8))
    for j, mode in enumerate(modes):
        xs, ys, labels = [], [], []
        for i, w in enumerate(workloads):
            r = by.get((w, mode))
            if r is None:
                continue
            xs.append(i + (j - (len(modes) - 1) / 2) * width)
            ys.append(r["ms"])
            labels.append("" if r["watts"] is None else f"{r['watts']:.0f} W\n{r['mhz']:.0f}")
        bars = ax.bar(xs, ys, width, label=mode)
        for b, text in zip(bars, labels):
            ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("ms per step, held back to back (labels: W, SM MHz)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=min(len(modes), 4))
    ax.margins(y=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step_json")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    with open(args.step_json) as f:
        record = json.load(f)
    rows = held_rows(record)
    if not rows:
        print(f"{args.step_json}: no held results (run bench step with --sustain-seconds)",
              file=sys.stderr)
        return 2
    b = sorted({r["b_dense"] for r in record["results"] if "b_dense" in r})
    plot(rows, args.out, f"{record.get('model', '')}, B_dense {b}, "
                         f"{record.get('num_layers', '?')} layers: the step held")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
