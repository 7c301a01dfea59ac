"""Merges the two parts of bench/repro/step/throughput_llama3_8b.sh into one result file, with
a markdown table and a throughput bar chart.

The step files give steady-state iteration throughput per mode (ratios within one process);
the engine files (engine_*.json) give end-to-end throughput of the engine, and of the
transformers peer on the same requests where it ran in the same call. A DIR may hold
engine files only.

Several DIRs (e.g. one per decode kernel) merge into one file; each row names its DIR.
A peer run made in a separate call (peer_*.json, `python -m nanojax.bench.peer ...` output)
is kept beside the engine's with its own request count.

Usage: python bench/repro/step/merge_throughput.py DIR [DIR ...] --out FILE.json [--png FILE.png]
"""
import argparse
import json
from pathlib import Path

STEP_FILES = ("step_2048.json", "step_bdense_sweep.json")
ENGINE_GLOB = "engine_*.json"  # the engine end to end, with the peer where it ran beside
KEEP = ("b_dense", "workload", "mode", "step_s", "tokens_per_s", "fraction_of_optimal",
        "fraction_of_optimal_at_790_tflops", "optimal_tokens_per_s", "gemm_tflops",
        "num_decodes", "num_prefill_tokens", "num_seqs", "rows", "logit_rows", "compile_s",
        "same_tokens_as_non-overlap", "differing_sequences", "repeat_same_tokens", "error")


def load(d: Path, name: str) -> dict | None:
    p = d / name
    return json.loads(p.read_text()) if p.is_file() else None


def ratios(run: str, rows: list[dict]) -> list[dict]:
    """Mode ratios per (B_dense, workload), from rows of one process (a file cut short by
    its time limit has rows but no ratios of its own)."""
    out = []
    for key in dict.fromkeys((r["b_dense"], r.get("workload")) for r in rows):
        t = {r["mode"]: r["tokens_per_s"] for r in rows
             if (r["b_dense"], r.get("workload")) == key and "tokens_per_s" in r}
        row = {f"{a.replace('-', '_')}_over_{b.replace('-', '_')}": t[a] / t[b]
               for a, b in (("overlap", "non-overlap"), ("overlap", "nanobatch-only"),
                            ("nanobatch-only", "non-overlap")) if a in t and b in t}
        if row:
            out.append({"run": run, "b_dense": key[0], "workload": key[1], **row})
    return out


def merge(dirs: list[Path]) -> dict:
    out = {"what": "LLaMA-3-8B shape, random bf16 weights, one H200, hand-written plan "
                   "llama3-8b-1gpu; steady-state dense iteration per mode (step; ratios "
                   "within one process) and the engine end to end against transformers "
                   "generate_batch (engine)",
           "commands": [], "partial": [], "step": [], "step_ratios": []}
    out["engine_runs"] = []
    for d in dirs:
        steps = [s for s in (load(d, n) for n in STEP_FILES) if s]
        engines = sorted(d.glob(ENGINE_GLOB))
        if not steps and not engines:
            raise SystemExit(f"{d}: none of {STEP_FILES} or {ENGINE_GLOB}")
        if steps:
            out.setdefault("env", steps[0].get("env"))
        for s in steps:
            out["commands"].append({"run": d.name, "command": s["command"]})
            if s.get("partial"):  # cut short: the modes it reached are still whole rows
                out["partial"].append(s["command"])
            out["step"] += [{"run": d.name, **{k: r[k] for k in KEEP if k in r}}
                            for r in s["results"]]
        for p in engines:
            eng = json.loads(p.read_text())
            out["commands"].append({"run": d.name, "command": eng["command"]})
            out["engine_runs"].append({"file": f"{d.name}/{p.name}", **{k: eng.get(k) for k in (
                "workload", "engine", "results", "peer", "ours_over_peer")}})
        out["step_ratios"] += ratios(d.name, [r for r in out["step"] if r["run"] == d.name])
        for p in sorted(d.glob("peer_*.json")):  # a peer run of its own call
            out["peer_separate_call"] = {"file": f"{d.name}/{p.name}", **json.loads(
                p.read_text())}
    out["ours_over_peer_across_calls"] = across_calls(out["engine_runs"])
    return out


def across_calls(runs: list[dict]) -> list[dict]:
    """Each engine run without a peer beside it against each peer run on the same
    requests in another call (the same-run ratio is in the run's own ours_over_peer)."""
    out = []
    for ours in runs:
        if ours.get("peer"):
            continue
        for other in runs:
            peer = other.get("peer") or {}
            if other["workload"] == ours["workload"] and peer.get("total_tokens_per_s"):
                for mode, r in ours["results"].items():
                    out.append({"ours": ours["file"], "mode": mode, "peer_from": other["file"],
                                "ours_tokens_per_s": r["total_tokens_per_s"],
                                "peer_tokens_per_s": peer["total_tokens_per_s"],
                                "ratio": r["total_tokens_per_s"] / peer["total_tokens_per_s"]})
    return out


def table(out: dict) -> str:
    lines = ["| run | B_dense | workload | mode | ms / iteration | tokens/s | of optimal | "
             "of 790 TFLOP/s | same tokens |", "|" + " --- |" * 9]
    for r in out["step"]:
        if "error" in r:
            lines.append(f"| {r['run']} | {r['b_dense']} | | {r['mode']} | failed: "
                         f"{r['error'][:60]} | | | | |")
            continue
        same = r.get("same_tokens_as_non-overlap")
        lines.append(
            f"| {r['run']} | {r['b_dense']} | {r['workload']} | {r['mode']} | "
            f"{1e3 * r['step_s']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {100 * r.get('fraction_of_optimal', 0):.1f}% | "
            f"{100 * r.get('fraction_of_optimal_at_790_tflops', 0):.1f}% | "
            + (f"{100 * same:.1f}% |" if same is not None else " |"))
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    """One panel per B_dense: bars per workload for each (run, mode), optimal dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in out["step"] if "tokens_per_s" in r]
    b_denses = sorted({r["b_dense"] for r in rows})
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    series = list(dict.fromkeys((r["run"], r["mode"]) for r in rows))
    colors = {s: plt.cm.tab10(i) for i, s in enumerate(series)}
    fig, axes = plt.subplots(len(b_denses), 1, figsize=(12, 2.6 * len(b_denses)),
                             squeeze=False)
    w = 0.8 / len(series)
    for ax, b in zip(axes[:, 0], b_denses):
        for i, s in enumerate(series):
            pts = [(j, r["tokens_per_s"]) for j, wl in enumerate(workloads) for r in rows
                   if (r["b_dense"], r["workload"], r["run"], r["mode"]) == (b, wl, *s)]
            if pts:
                ax.bar([j + i * w for j, _ in pts], [y for _, y in pts], w,
                       color=colors[s], label=" ".join(s).removeprefix("throughput_"))
        opt = next((r["tokens_per_s"] / r["fraction_of_optimal"] for r in rows
                    if r["b_dense"] == b and r.get("fraction_of_optimal")), None)
        if opt:
            ax.axhline(opt, color="k", linestyle=":", linewidth=1)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(workloads))])
        ax.set_xticklabels(workloads)
        ax.set_ylabel(f"B_dense {b}\ntokens/s")
    axes[0, 0].set_title("LLaMA-3-8B shape, 1x H200, steady-state iteration per mode "
                         "(dotted: optimal at that B_dense)")
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default=None)
    a = ap.parse_args()
    out = merge([Path(d) for d in a.dirs])
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(table(out))
    for r in out["step_ratios"]:
        print(json.dumps(r))
    for e in out["engine_runs"]:
        print("engine", e["file"], json.dumps({m: {k: r.get(k) for k in (
            "total_tokens_per_s", "compiles_during_run", "mean_batch_fill")}
            for m, r in e["results"].items()}), "ours/peer (same run):", e["ours_over_peer"])
    for r in out["ours_over_peer_across_calls"]:
        print("ours/peer across calls:", json.dumps(r))
    print("peer (separate call):", json.dumps(out.get("peer_separate_call"))[:300])
    if a.png:
        plot(out, a.png)


if __name__ == "__main__":
    main()
