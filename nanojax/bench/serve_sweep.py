"""The online latency sweep (NanoFlow's Fig. 8): `nanojax bench serve --request-rates ...`.

One server, one rate after another: at each rate, fresh requests (their own seed, so the
prefix cache cannot serve one rate's prompts to the next) arrive as a Poisson process for
about --sweep-seconds; the sweep stops once the mean normalized latency (end-to-end time
over output tokens) passes --stop-factor x the 200 ms/token SLO, the server being
saturated. The result names the highest rate whose mean normalized latency is within the
SLO with no failed request and at which the server kept up (requests finished at >=
KEPT_UP x the rate they arrived over the second half of the arrivals: a run of a few
seconds past saturation drains its queue before the latency passes the SLO).

    python -m nanojax.bench.serve_sweep A.json [B.json ...] --out sweep.png
plots the sweeps of several runs (traces, with and without a plan) in one figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

# the service-level objective on normalized latency (NanoFlow section 6.3's 200 ms/token)
SLO_S_PER_TOKEN = 0.2
# a rate the server keeps up with: finishes >= this share of the requests arriving
KEPT_UP = 0.8


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"nanojax: --request-rates must be numbers, got {text!r}") from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise SystemExit(f"nanojax: --request-rates must be positive and finite, got {text!r}")
    return sorted(rates)


def run_sweep(run, url: str, model: str, rates: list[float], make_requests, seconds: float,
              seed: int = 0, api_key=None, max_concurrency=None, progress=True,
              stop_factor: float = 2.0) -> dict:
    """run: the client's coroutine (bench/serve.py run_serve_bench); make_requests(n,
    seed) -> requests; about `seconds` of arrivals at each rate."""
    points = []
    for i, rate in enumerate(rates):
        n = max(1, math.ceil(rate * seconds))
        s = asyncio.run(run(url, model, make_requests(n, seed + i), rate, seed + i, api_key,
                            max_concurrency, progress))
        s.pop("per_request", None)  # one summary per rate keeps the file readable
        points.append(s)
        mean = s["normalized_latency_s_per_token"]["mean"]
        if progress:
            print(f"rate {rate:g}/s: {n} requests, mean normalized latency "
                  f"{'n/a' if mean is None else f'{1e3 * mean:.1f} ms/token'}, "
                  f"{s['total_token_throughput']:.0f} tokens/s", file=sys.stderr)
        if mean is None or mean > stop_factor * SLO_S_PER_TOKEN:
            break
    return {"sweep": points, "rates_planned": rates, "sweep_seconds": seconds,
            "stop_factor": stop_factor, "slo_s_per_token": SLO_S_PER_TOKEN,
            "saturated": len(points) < len(rates) or _over_slo(points[-1]),
            "max_rate_within_slo": max((p["request_rate"] for p in points
                                        if not _over_slo(p)), default=None)}


def _over_slo(p: dict) -> bool:
    mean = p["normalized_latency_s_per_token"]["mean"]
    ratio = p.get("completion_ratio_late")  # absent in sweeps run before it was measured
    return (p["failed_requests"] > 0 or mean is None or mean > SLO_S_PER_TOKEN
            or (ratio is not None and ratio < KEPT_UP))


def merge_sweeps(results: list[dict]) -> dict:
    """One trace's sweeps over several rate ranges (separate runs) as one sweep."""
    points = sorted((p for r in results for p in r["sweep"]), key=lambda p: p["request_rate"])
    return {**results[0], "sweep": points,
            "rates_planned": sorted({x for r in results for x in r["rates_planned"]}),
            "saturated": any(r["saturated"] for r in results),
            "max_rate_within_slo": max((p["request_rate"] for p in points
                                        if not _over_slo(p)), default=None)}


def sweep_series(result: dict) -> dict:
    """Rates and mean / p99 normalized latency (ms/token) of one sweep, for the plot."""
    pts = [p for p in result["sweep"] if p["normalized_latency_s_per_token"]["mean"] is not None]
    return {"rate": [p["request_rate"] for p in pts],
            "mean_ms": [1e3 * p["normalized_latency_s_per_token"]["mean"] for p in pts],
            "p99_ms": [1e3 * p["normalized_latency_s_per_token"]["p99"] for p in pts],
            "served": [p.get("request_throughput") for p in pts]}


def plot_sweeps(results: dict[str, dict], path) -> None:
    """label -> sweep result: mean (solid) and p99 (dashed) normalized latency vs rate,
    and beside it the requests served per second (successes over the run's wall time,
    drain included) vs the rate: where it flattens, the server is saturated."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    top = 1.0
    for i, (label, res) in enumerate(results.items()):
        s, color = sweep_series(res), f"C{i}"
        best = res.get("max_rate_within_slo")
        ax.plot(s["rate"], s["mean_ms"], "o-", color=color,
                label=f"{label} (SLO up to {best:g}/s)" if best else f"{label} (never in SLO)")
        ax.plot(s["rate"], s["p99_ms"], "x--", color=color, alpha=0.6)
        if all(x is not None for x in s["served"]):
            ax2.plot(s["rate"], s["served"], "o-", color=color, label=label)
            top = max(top, *s["rate"])
    ax.axhline(1e3 * SLO_S_PER_TOKEN, color="gray", ls=":", label="200 ms/token SLO")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (ms/token)\nmean (solid), p99 (dashed)")
    ax2.plot([0, top], [0, top], color="gray", ls=":", label="served = rate")
    ax2.set_xlabel("request rate (requests/s)")
    ax2.set_ylabel("requests served per second\n(over the run, drain included)")
    for a in (ax, ax2):
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="plot `nanojax bench serve --request-rates` "
                                             "results in one figure")
    ap.add_argument("files", nargs="+", help="JSON files of sweeps (label: the file's stem; "
                    "files of one stem, rate ranges run apart, plot as one sweep)")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args(argv)
    results = {}
    for f in a.files:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"nanojax: cannot read {f}: {e}") from None
        if "sweep" not in d:
            raise SystemExit(f"nanojax: {f} holds no sweep (run with --request-rates)")
        results.setdefault(Path(f).stem, []).append(d)
    plot_sweeps({k: merge_sweeps(v) for k, v in results.items()}, a.out)
    print(f"nanojax: wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
