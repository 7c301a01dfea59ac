"""One figure of the overlap pair over its GEMM share G, from fused_pair.py's JSON and,
when given and present, green_context_pair.py's (same layout: pair_record.py). A row per
GEMM: pair time and back to back (ms), gain = back_to_back / pair (with the 1.0 line),
SM clock (MHz) and power (W) while the pair runs (dashed: back to back).

    python3 bench/kernels/plot_fused_pair.py FUSED.json [GREEN.json] --out fused_pair.png

FUSED.json may also be a profile written by `nanojax profile --pair-shares` (its "pair").

x is the GEMM's SM count the pair actually got (gemm_sms: G for the fused launch, the
green context's rounded count for PyTorch). Rows that record an error are left out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

PANELS = ("pair time (ms)", "gain over back to back", "SM clock (MHz)", "power (W)")


def load(path: str | None) -> dict | None:
    """The record, or None (with a note on stderr) when the file is absent or unreadable:
    a bench cut short or failed must not stop the plot of the other."""
    if path is None:
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"plot_fused_pair: skipping {path}: {e}", file=sys.stderr)
        return None
    # a profile of `nanojax profile --pair-shares` carries the pair as its "pair"
    return (record["pair"] if isinstance(record, dict) and isinstance(record.get("pair"), dict)
            else record)


def _power(c: dict | None, key: str) -> float:
    p = (c or {}).get("power") or {}
    return float(p.get(key, math.nan))


def series(record: dict, gemm: str) -> dict | None:
    """What the plot draws for one GEMM of one record (None: no entry or an error).
    gain[i] = back_to_back ms / pair ms of the i-th measured share."""
    entry = record.get("gemms", {}).get(gemm)
    if not entry or "error" in entry or "back_to_back" not in entry:
        return None
    b2b = entry["back_to_back"]
    rows = [r for r in entry.get("shares", []) if "error" not in r and "pair" in r]
    rows.sort(key=lambda r: r.get("gemm_sms", r["G"]))
    pair_ms = [r["pair"]["ms"] for r in rows]
    return {"label": record.get("impl", "?"),
            "G": [r["G"] for r in rows],
            "gemm_sms": [r.get("gemm_sms", r["G"]) for r in rows],
            "pair_ms": pair_ms,
            "back_to_back_ms": b2b["ms"],
            "gain": [b2b["ms"] / t for t in pair_ms],
            "clock": [_power(r["pair"], "sm_clock_mhz_mean") for r in rows],
            "power": [_power(r["pair"], "power_w_mean") for r in rows],
            "back_to_back_clock": _power(b2b, "sm_clock_mhz_mean"),
            "back_to_back_power": _power(b2b, "power_w_mean"),
            "errors": len(entry.get("shares", [])) - len(rows)}


def plot(records: list[dict | None], out: str):
    """records: fused's then green's (None: absent, its colour stays unused)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [r for r in records if r is not None]
    gemms = list(dict.fromkeys(g for r in present for g in r.get("gemms", {})))
    fig, axes = plt.subplots(max(len(gemms), 1), len(PANELS), squeeze=False, sharex=True,
                             figsize=(4.2 * len(PANELS), 3.0 * max(len(gemms), 1)))
    axes[0, 0].set_xlim(0, max([r.get("programs", 132) for r in present] or [132]))
    for row, gemm in enumerate(gemms):
        ax_t, ax_g, ax_c, ax_p = axes[row]
        ax_g.axhline(1.0, color="gray", lw=0.8)
        for i, record in enumerate(records):
            if record is None:
                continue
            color, label, s = f"C{i}", record.get("impl", "?"), series(record, gemm)
            if s is None:
                ax_t.text(0.02, 0.95 - 0.1 * i, f"{label}: no rows",
                          transform=ax_t.transAxes, color=color, fontsize=8, va="top")
                continue
            x = s["gemm_sms"]
            ax_t.plot(x, s["pair_ms"], "o-", color=color, label=f"{label} pair")
            ax_t.axhline(s["back_to_back_ms"], color=color, ls="--",
                         label=f"{label} back to back")
            ax_g.plot(x, s["gain"], "o-", color=color, label=label)
            ax_c.plot(x, s["clock"], "o-", color=color)
            ax_c.axhline(s["back_to_back_clock"], color=color, ls="--")
            ax_p.plot(x, s["power"], "o-", color=color)
            ax_p.axhline(s["back_to_back_power"], color=color, ls="--")
        ax_t.set_ylabel(gemm)
        for ax, title in zip(axes[row], PANELS):
            ax.set_title(f"{gemm}: {title}", fontsize=9)
            if row == len(gemms) - 1:
                ax.set_xlabel("GEMM SMs (G)")
            ax.grid(alpha=0.3)
        if ax_t.get_legend_handles_labels()[0]:
            ax_t.legend(fontsize=7)
    dev = present[0].get("device", "") if present else ""
    fig.suptitle(f"GEMM + decode attention pair over the GEMM's SMs ({dev}; "
                 "dashed: back to back at the full grid)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fused", help="fused_pair.py's JSON")
    p.add_argument("green", nargs="?", help="green_context_pair.py's JSON (optional)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    records = [load(args.fused), load(args.green)]
    if records == [None, None]:
        raise SystemExit(f"plot_fused_pair: neither {args.fused} nor {args.green} could "
                         "be read")
    plot(records, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
