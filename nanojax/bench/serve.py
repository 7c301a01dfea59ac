"""`nanojax bench serve`: an online benchmark client, like vLLM's `bench serve`.

Requests (random token ids of fixed or trace lengths) arrive as a Poisson process at
--request-rate; each streams from /v1/completions with ignore_eos, so it yields exactly
its output length. Latencies are measured at the client.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time

import numpy as np

from nanojax.bench.serve_sweep import SLO_S_PER_TOKEN, parse_rates, plot_sweeps, run_sweep
from nanojax.bench.workload import BenchRequest, add_workload_args, make_requests
from nanojax.profiling.record import write_json


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = dataclasses.field(default_factory=list)
    start: float = 0.0


async def _one(session, url, model, req: BenchRequest, api_key) -> RequestResult:
    import aiohttp
    res = RequestResult(prompt_len=len(req.prompt_ids))
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = last = time.perf_counter()
    res.start = t0
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("usage"):
                    res.output_len = data["usage"]["completion_tokens"]
                if data.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_len > 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_serve_bench(url: str, model: str, requests: list[BenchRequest],
                          request_rate: float, seed: int = 0, api_key=None,
                          max_concurrency: int | None = None, progress=True) -> dict:
    import aiohttp
    from tqdm.auto import tqdm
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), unit="req", disable=not progress)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def guarded(req):
            if sem is None:
                r = await _one(session, url, model, req, api_key)
            else:
                async with sem:
                    r = await _one(session, url, model, req, api_key)
            bar.update(1)
            return r

        tasks = []
        t_start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(guarded(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
    bar.close()
    return summarize(results, duration, request_rate)


def _stats(xs, scale=1000.0) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(xs) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99))}


def completion_ratio_late(results: list[RequestResult]) -> float | None:
    """Requests finished over requests arrived in the second half of the arrivals: ~1 when
    the server keeps up with the rate, its capacity over the rate when a queue grows (a
    short run past saturation ends before the queue pushes the latency past the SLO)."""
    if len(results) < 2:
        return None
    starts = [r.start for r in results]
    lo, hi = (min(starts) + max(starts)) / 2, max(starts)
    arrived = sum(lo <= t <= hi for t in starts)
    done = sum(lo <= r.start + r.e2e <= hi for r in results if r.ok)
    return done / arrived if arrived else None


def summarize(results: list[RequestResult], duration: float, request_rate: float) -> dict:
    ok = [r for r in results if r.ok]
    inp = sum(r.prompt_len for r in ok)
    out = sum(r.output_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    norm = [r.e2e / r.output_len for r in ok]
    return {
        "request_rate": request_rate, "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(ok) / duration, "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2e_ms": _stats([r.e2e for r in ok]),
        "normalized_latency_s_per_token": {k: v / 1000 if v is not None else None for k, v in
                                           _stats(norm).items() if k != "median"},
        "slo_200ms_per_token_share": (sum(x <= SLO_S_PER_TOKEN for x in norm) / len(ok)
                                      if ok else 0.0),
        "completion_ratio_late": completion_ratio_late(results),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "per_request": [dataclasses.asdict(r) for r in results],
    }


def print_report(s: dict, out=None) -> None:
    """vLLM's `bench serve` table. out: a stream (None: sys.stdout as it is at the call,
    not at import: a test's captured stdout may be closed by then)."""
    out = out or sys.stdout
    line = "=" * 50
    rows = [("Successful requests", s["successful_requests"]),
            ("Failed requests", s["failed_requests"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        for stat in ("mean", "median", "p99"):
            v = s[key][stat]
            rows.append((f"{stat.capitalize()} {key.split('_')[0].upper()} (ms)",
                         "n/a" if v is None else f"{v:.2f}"))
    nl = s["normalized_latency_s_per_token"]
    rows += [("Mean normalized latency (s/tok)", "n/a" if nl["mean"] is None else f"{nl['mean']:.4f}"),
             ("P99 normalized latency (s/tok)", "n/a" if nl["p99"] is None else f"{nl['p99']:.4f}"),
             ("Within 200 ms/token SLO", f"{100 * s['slo_200ms_per_token_share']:.1f}%")]
    print(f"{line}\n{'Serving Benchmark Result':^50}\n{line}", file=out)
    for k, v in rows:
        print(f"{k:<38}{v:>12}", file=out)
    print(line, file=out)


def _get_json(url: str, api_key: str | None):
    import urllib.request
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return json.load(r)


def server_record(url: str, api_key: str | None) -> dict | None:
    """What the server says it runs (nanojax's GET /server_info: its command, XLA flags,
    engine config, plan), recorded beside the figures; None from a server without it."""
    import urllib.error
    try:
        return _get_json(url + "/server_info", api_key)
    except (urllib.error.URLError, ValueError):
        return None


def cmd_bench_serve(args) -> int:
    url = args.base_url.rstrip("/")
    info = _get_json(url + "/v1/models", args.api_key)["data"][0]
    model = args.served_model or info["id"]
    record = {"command": " ".join(["nanojax"] + sys.argv[1:]), "base_url": url,
              "model": model, "server": server_record(url, args.api_key)}
    vocab = args.vocab_size
    if args.multi_round:  # conversations: turns of one conversation in order
        from nanojax.bench.multi_round import run_conversations_online
        from nanojax.bench.workload import make_conversations
        convs = make_conversations(args.num_prompts, args.multi_round, vocab, args.input_len,
                                   args.output_len, args.trace, info.get("max_model_len"),
                                   args.seed)
        s = asyncio.run(run_conversations_online(url, model, convs, args.request_rate,
                                                 args.seed, args.api_key, not args.quiet))
        print(json.dumps({k: v for k, v in s.items() if k != "errors"}, indent=1))
        write_json(args.json, {**record, "multi_round": args.multi_round, **s})
        return 0 if s["failed_turns"] == 0 else 1
    if args.request_rates:  # the latency sweep over rates (bench/serve_sweep.py)
        rates = parse_rates(args.request_rates)

        def make(n, seed):
            return make_requests(n, vocab, args.input_len, args.output_len, args.trace,
                                 info.get("max_model_len"), seed)
        s = run_sweep(run_serve_bench, url, model, rates, make, args.sweep_seconds, args.seed, args.api_key,
                      args.max_concurrency, not args.quiet, args.stop_factor)
        print(json.dumps({"max_rate_within_slo": s["max_rate_within_slo"],
                          "saturated": s["saturated"], "rates_run": [
                              p["request_rate"] for p in s["sweep"]]}))
        write_json(args.json, {**record, "trace": args.trace, **s})
        if args.png:
            plot_sweeps({args.trace or "fixed lengths": s}, args.png)
        return 0
    reqs = make_requests(args.num_prompts, vocab, args.input_len, args.output_len, args.trace,
                         info.get("max_model_len"), args.seed)
    s = asyncio.run(run_serve_bench(url, model, reqs, args.request_rate, args.seed,
                                    args.api_key, args.max_concurrency, not args.quiet))
    print_report(s)
    if args.json:
        write_json(args.json, {**record, **s})
    return 0 if s["failed_requests"] == 0 else 1


def register_serve(bsub) -> None:
    p = bsub.add_parser("serve", help="online benchmark against a running server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--served-model", default=None)
    p.add_argument("--api-key", default=None)
    add_workload_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson); inf sends all at once")
    p.add_argument("--request-rates", default=None, metavar="R1,R2,...",
                   help="a latency sweep: these rates in turn, ~--sweep-seconds of arrivals "
                        "each (fresh prompts per rate), until the server saturates")
    p.add_argument("--sweep-seconds", type=float, default=60.0)
    p.add_argument("--stop-factor", type=float, default=2.0,
                   help="the sweep stops past this many times the 200 ms/token SLO")
    p.add_argument("--png", default=None, help="with --request-rates: the latency curve")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--multi-round", type=int, default=0, metavar="N",
                   help="--num-prompts conversations of up to N turns, each sent when the "
                        "previous one finished; --request-rate is then conversations per s")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="random prompt ids are drawn below this")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_bench_serve)
