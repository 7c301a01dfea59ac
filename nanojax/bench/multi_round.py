"""Multi-round conversations through the engine (offline) and a server (online).

A conversation's turn k is sent only when turn k-1 has finished: its prompt is the
previous prompt, the previous answer's token ids and a new user message. With KV reuse
(prefix caching, offload tiers) a returning turn computes only its new tokens; without
it, it recomputes the whole history. Throughput counts every prompt token (history
included) and every output token, as a server would serve them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time

import numpy as np

from nanojax.bench.workload import Conversation
from nanojax.engine.sampling import SamplingParams


@dataclasses.dataclass
class TurnResult:
    conversation: int
    turn: int
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0    # from when the turn was sent (its previous turn finished)
    ok: bool = True
    error: str = ""


def _stats_ms(xs) -> dict:
    if not xs:
        return {"count": 0, "mean": None, "median": None, "p99": None}
    a = np.asarray(xs) * 1000.0
    return {"count": len(xs), "mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99))}


def summarize_turns(turns: list[TurnResult], wall: float) -> dict:
    ok = [t for t in turns if t.ok]
    prompt = sum(t.prompt_len for t in ok)
    output = sum(t.output_len for t in ok)
    return {
        "conversations": len({t.conversation for t in turns}), "turns": len(ok),
        "failed_turns": len(turns) - len(ok),
        "prompt_tokens": prompt, "output_tokens": output, "wall_s": wall,
        "total_tokens_per_s": (prompt + output) / wall if wall else None,
        "output_tokens_per_s": output / wall if wall else None,
        "ttft_first_turn_ms": _stats_ms([t.ttft for t in ok if t.turn == 0]),
        "ttft_returning_turns_ms": _stats_ms([t.ttft for t in ok if t.turn > 0]),
        "errors": sorted({t.error for t in turns if t.error})[:10],
    }


def run_conversations_offline(engine, convs: list[Conversation], progress: bool = False,
                              warmup: bool = True, timeline=None) -> dict:
    """All first turns arrive at once; each later turn arrives when its previous finishes.
    timeline: a nanojax.bench.offline.TimelineWindow of iterations to profile."""
    from tqdm.auto import tqdm

    from nanojax.bench.offline import run_with_window
    from nanojax.engine.gc_freeze import frozen_startup_objects
    if warmup and engine.runner.fixed_shapes:
        engine.runner.warmup()
    convs = [c for c in convs if c.turns]
    history: dict[int, list[int]] = {}
    owner: dict[str, tuple[int, int]] = {}
    results: list[TurnResult] = []
    digests: list[str] = []

    def send(c: int, k: int) -> None:
        user, out_len = convs[c].turns[k]
        prompt = history.get(c, []) + list(user)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True,
                                                        temperature=0))
        owner[rid] = (c, k)
        history[c] = prompt

    s0 = dataclasses.replace(engine.stats)
    computed0 = engine.stats.prompt_tokens
    pc = engine.prefix_cache
    q0, h0, t0_hits = ((pc.stats.queries, pc.stats.hits, pc.stats.tier_hits) if pc
                       else (0, 0, 0))
    t0 = time.perf_counter()
    for c in range(len(convs)):
        send(c, 0)
    total = sum(len(c.turns) for c in convs)
    with (tqdm(total=total, desc="turns", unit="turn", disable=not progress) as bar,
          frozen_startup_objects(engine.config.gc_freeze)):  # as run_to_completion: nanojax/engine/gc_freeze.py
        def advance(max_steps: int | None) -> None:
            while not engine.is_idle and (max_steps is None or max_steps > 0):
                for out in engine.step():
                    if not out.finished:
                        continue
                    c, k = owner.pop(out.request_id)
                    results.append(TurnResult(c, k, len(out.prompt_token_ids),
                                              len(out.outputs[0].token_ids),
                                              out.first_token_latency or 0.0))
                    digests.append(f"{c}.{k}:" + hashlib.sha1(
                        str(out.outputs[0].token_ids).encode()).hexdigest()[:12])
                    history[c] = history[c] + list(out.outputs[0].token_ids)
                    bar.update(1)
                    if k + 1 < len(convs[c].turns):
                        send(c, k + 1)
                max_steps = None if max_steps is None else max_steps - 1

        window = run_with_window(engine, advance, timeline)
    wall = time.perf_counter() - t0
    out = summarize_turns(results, wall)
    out.update({
        "prompt_tokens_computed": engine.stats.prompt_tokens - computed0,
        "iterations": engine.stats.steps - s0.steps,
        "preemptions": engine.scheduler.num_preemptions,
        "output_digests": sorted(digests),
        **({"timeline": window} if window else {}),
    })
    if pc is not None:
        out["prefix_cache"] = {"queries": pc.stats.queries - q0, "hits": pc.stats.hits - h0,
                               "tier_hits": pc.stats.tier_hits - t0_hits,
                               "gpu_evictions": engine.allocator.num_evictions}
    if engine.offloader is not None:
        engine.offloader.drain()
        off = engine.offloader
        out["offload"] = {**dataclasses.asdict(off.stats),
                          "host_bytes": off.host.bytes if off.host else 0,
                          "disk_bytes": off.disk.bytes if off.disk else 0,
                          "disk_corrupt": off.disk.num_corrupt if off.disk else 0}
    return out


# ---- online: `nanojax bench serve --multi-round N` -----------------------------------------
async def _turn(session, url, model, prompt: list[int], out_len: int, api_key):
    """Streams one turn; returns (answer ids, ttft, error). The answer's ids come back as
    logprob tokens, which a tokenizer-less (random) model spells as the ids themselves."""
    import aiohttp
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    ttft, tokens = 0.0, []
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                return [], 0.0, f"HTTP {r.status}: {(await r.text())[:200]}"
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for ch in json.loads(line[6:]).get("choices", []):
                    if ttft == 0.0:
                        ttft = time.perf_counter() - t0
                    tokens += (ch.get("logprobs") or {}).get("tokens") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return [], 0.0, f"{type(e).__name__}: {e}"
    try:
        ids = [int(t) for t in tokens]
    except ValueError:  # a real tokenizer: the answer is not reused as ids
        ids = []
    if not ids and tokens:
        ids = [1000 + (sum(map(ord, t)) % 1000) for t in tokens]
    return ids, ttft, ""


async def run_conversations_online(url: str, model: str, convs: list[Conversation],
                                   conversation_rate: float, seed: int = 0, api_key=None,
                                   progress: bool = True) -> dict:
    """Conversations start as a Poisson process; each sends its turns in order."""
    import aiohttp
    from tqdm.auto import tqdm
    rng = np.random.default_rng(seed)
    convs = [c for c in convs if c.turns]
    bar = tqdm(total=sum(len(c.turns) for c in convs), unit="turn", disable=not progress)
    results: list[TurnResult] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
        async def converse(c: int, conv: Conversation):
            history: list[int] = []
            for k, (user, out_len) in enumerate(conv.turns):
                prompt = history + list(user)
                ids, ttft, err = await _turn(session, url, model, prompt, out_len, api_key)
                results.append(TurnResult(c, k, len(prompt), len(ids), ttft, not err, err))
                bar.update(1)
                if err:
                    return
                history = prompt + ids

        t0 = time.perf_counter()
        tasks = []
        for c, conv in enumerate(convs):
            tasks.append(asyncio.create_task(converse(c, conv)))
            if conversation_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / conversation_rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    bar.close()
    return summarize_turns(results, wall)


# ---- `nanojax bench --multi-round N [--reuse-modes ...]` -------------------------------------
REUSE_MODES = ("recompute", "prefix", "offload")


def add_multi_round_args(p) -> None:
    p.add_argument("--multi-round", type=int, default=0, metavar="N",
                   help="run --num-prompts conversations of up to N turns (each turn appends "
                        "the previous answer and a new message of --input-len or trace "
                        "length); 1 is a single-round workload through the same driver")
    p.add_argument("--reuse-modes", default=None,
                   help="compare KV reuse modes in one process, comma-separated: recompute "
                        "(no prefix caching), prefix (GPU prefix caching), offload (prefix "
                        "caching + the --kv-offload-* tiers)")


def _warm(engine, vocab: int, n: int, seed: int) -> None:
    """Compiles common shapes outside the timed region with prompts that share nothing
    with the workload (a warm-up must not seed the prefix cache)."""
    if engine.offloader is not None:  # the page copies' shapes too
        engine.offloader.warmup()
    if engine.runner.fixed_shapes:
        engine.runner.warmup()
        return
    rng = np.random.default_rng(seed + 7919)
    for _ in range(n):
        engine.add_request(rng.integers(1, vocab, size=64).tolist(),
                           SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    engine.run_to_completion()


def mode_config(mode: str, args) -> dict:
    from nanojax.config_flags import engine_config_from_args
    c = engine_config_from_args(args)
    kv = {"enable_prefix_caching": c.enable_prefix_caching,
          "kv_offload_host_bytes": c.kv_offload_host_bytes,
          "kv_offload_dir": c.kv_offload_dir, "kv_offload_disk_bytes": c.kv_offload_disk_bytes}
    if mode == "recompute":
        return {**kv, "enable_prefix_caching": False, "kv_offload_host_bytes": 0,
                "kv_offload_dir": None}
    if mode == "prefix":
        return {**kv, "enable_prefix_caching": True, "kv_offload_host_bytes": 0,
                "kv_offload_dir": None}
    if mode == "offload":
        if not kv["kv_offload_host_bytes"] and not kv["kv_offload_dir"]:
            raise SystemExit("nanojax: --reuse-modes offload needs --kv-offload-host-bytes "
                             "or --kv-offload-dir")
        return {**kv, "enable_prefix_caching": True}
    if mode == "flags":
        return kv
    raise SystemExit(f"nanojax: unknown reuse mode {mode!r}: one of {REUSE_MODES}")


def cmd_multi_round(args, bundle) -> int:
    import gc
    import sys

    from nanojax.bench.workload import make_conversations
    from nanojax.config_flags import engine_config_from_args
    from nanojax.engine.llm_engine import LLMEngine
    from nanojax.profiling.record import run_record, write_json
    if args.plan or args.peer or args.scheduling == "both":
        raise SystemExit("nanojax: --multi-round/--reuse-modes run the plain engine with one "
                         "scheduling mode (no --plan, --peer, --scheduling both)")
    modes = args.reuse_modes.split(",") if args.reuse_modes else ["flags"]
    for m in modes:
        mode_config(m, args)  # bad modes fail before any run
    config = engine_config_from_args(args, async_scheduling=args.scheduling != "sync")
    convs = make_conversations(args.num_prompts, max(1, args.multi_round),
                               bundle.config.vocab_size, args.input_len, args.output_len,
                               args.trace, config.max_model_len, args.seed)
    record = run_record(config, bundle.config)
    cmd = record["command"]
    results = {}
    for mode in modes:
        eng = LLMEngine(bundle, config.replace(**mode_config(mode, args)))
        _warm(eng, bundle.config.vocab_size, eng.scheduler.max_num_seqs, args.seed)
        from nanojax.bench.offline import timeline_window
        results[mode] = r = run_conversations_offline(
            eng, convs, progress=not args.quiet, timeline=timeline_window(args, mode, modes))
        if eng.offloader is not None:
            eng.offloader.close()
        eng = None
        gc.collect()  # the runner's jitted step holds the engine: free its KV cache now
        print(f"{mode:>9}: {r['turns']} turns, {r['prompt_tokens']} prompt "
              f"({r['prompt_tokens_computed']} computed) + {r['output_tokens']} output tokens "
              f"in {r['wall_s']:.2f}s -> {r['total_tokens_per_s']:.1f} tok/s; TTFT returning "
              f"turns median {r['ttft_returning_turns_ms']['median']} ms", file=sys.stderr)
        write_json(args.json, {"command": cmd, "partial": True, "results": results})
    digests = {m: r.pop("output_digests") for m, r in results.items()}
    first = modes[0]
    for m in modes[1:]:  # greedy: the share of turns whose tokens reuse left unchanged
        ref = set(digests[first])
        results[m]["same_outputs_as_" + first] = (
            sum(d in ref for d in digests[m]) / max(len(digests[m]), 1))
    payload = {**record, "model": args.model,
               "workload": {"conversations": args.num_prompts, "rounds": args.multi_round,
                            "turns": sum(len(c.turns) for c in convs),
                            "input_len": args.input_len, "output_len": args.output_len,
                            "trace": args.trace, "seed": args.seed},
               "results": results}
    tp = {m: r["total_tokens_per_s"] for m, r in results.items()}
    for m in modes[1:]:
        payload[f"{m}_over_{first}"] = tp[m] / tp[first]
    print(json.dumps({k: v for k, v in payload.items() if k.endswith(f"_over_{first}")}))
    write_json(args.json, payload)
    return 0
