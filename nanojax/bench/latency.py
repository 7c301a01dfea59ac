"""`nanojax bench latency`: single-stream decode, long-prompt prefill and a small batch,
nanojax against transformers on the same GGUF weights, in one process.

Both sides run float32 on the same cores, greedy, with EOS ignored (every generation is
exactly its length), from the same token ids. Ours goes through the public `LLM.generate`
(scheduler, runner, async loop: what a user meets); theirs through `model.generate`. Each
measurement runs once to warm up (compiles, allocator, caches) and is then repeated with
fresh prompts of the same lengths (a repeated prompt would hit our prefix cache), ours
and theirs alternating so that load from elsewhere on the machine hits both alike; the
median is reported.

Measured: decode tokens/s of one stream (new tokens / wall time of the generation, its
short prompt's prefill included on both sides); the time to the first token of a long
prompt (a generation of one token); the aggregate tokens/s of a batch of streams, and its
scaling over one stream.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CASES = ("decode", "prefill", "batch")
FORWARDS = {"layerwise": "LayerwiseForward", "scan": "ScanForward",
            "unrolled": "UnrolledForward"}
DECODE_PROMPT = ("The history of the printing press begins in the fifteenth century, when "
                 "Johannes Gutenberg")


class TransformersPeer:
    """transformers' own GGUF import of the file, run with `model.generate` (f32)."""

    def __init__(self, gguf_path: str | os.PathLike, threads: int):
        import torch
        import transformers
        torch.set_num_threads(threads)
        path = Path(gguf_path)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        self.stack = (f"transformers {transformers.__version__} generate "
                      f"({self.model.config._attn_implementation}), torch {torch.__version__}")

    @classmethod
    def from_model(cls, model, threads: int) -> "TransformersPeer":
        """A peer around a model already built (tests: a tiny random LLaMA)."""
        import torch
        import transformers
        torch.set_num_threads(threads)
        peer = cls.__new__(cls)
        peer.torch, peer.model = torch, model.eval()
        peer.stack = f"transformers {transformers.__version__} generate, torch {torch.__version__}"
        return peer

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy, EOS ignored; prompts of one length (no padding)."""
        from transformers import GenerationConfig
        torch = self.torch
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        x = torch.tensor(prompts)
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x),
                                      generation_config=gen)
        return out[:, x.shape[1]:].tolist()


def _ours(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from nanojax.engine.sampling import SamplingParams
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _timed(fn, *args) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _prompts(rng, vocab: int, n: int, length: int) -> list[list[int]]:
    low = min(1000, vocab // 2)  # skip the special tokens at the start of the vocabulary
    return [rng.integers(low, vocab, size=length).tolist() for _ in range(n)]


def run_latency(llm, peer: TransformersPeer | None, *, new_tokens: int = 128,
                prefill_tokens: int = 1500, batch: int = 8, repeats: int = 3,
                decode_prompt: list[int] | None = None, seed: int = 0,
                progress: bool = True, cases: tuple[str, ...] = CASES) -> dict:
    """The measurements named in cases (default all three) for ours (an LLM) and, if
    given, the peer. Returns the per-repeat times, medians and ratios (ours over theirs:
    > 1 is ours faster)."""
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        raise ValueError(f"cases must be some of {', '.join(CASES)}, got {list(cases)}")
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    if decode_prompt is None:
        decode_prompt = _prompts(rng, vocab, 1, 16)[0]
    sides = {"ours": lambda p, n: _ours(llm, p, n)}
    if peer is not None:
        sides["transformers"] = peer.generate
    batch_len = len(decode_prompt)
    # (name, prompts per repeat, new tokens): fresh prompts each round, the first is warm-up
    makers = {
        "decode": lambda i: ([decode_prompt] if i == 0 else  # a new first token: no cache hit
                             [_prompts(rng, vocab, 1, 1)[0] + decode_prompt[1:]], new_tokens),
        "prefill": lambda i: (_prompts(rng, vocab, 1, prefill_tokens), 1),
        "batch": lambda i: (_prompts(rng, vocab, batch, batch_len), new_tokens),
    }
    cases = {c: makers[c] for c in CASES if c in cases}
    times = {c: {s: [] for s in sides} for c in cases}
    tokens = {}
    for case, make in cases.items():
        for i in range(repeats + 1):
            prompts, n = make(i)
            for side, gen in sides.items():
                wall, out = _timed(gen, prompts, n)
                if any(len(o) != n for o in out):
                    raise RuntimeError(f"{side} {case}: produced {[len(o) for o in out]} "
                                       f"tokens, asked for {n} per prompt")
                if i == 0:  # warm-up: compiles (ours), allocator and caches (both)
                    tokens[(case, side)] = out
                    continue
                times[case][side].append(wall)
                if progress:
                    print(f"{case:>7} {side:>12} round {i}: {wall:7.3f} s", file=sys.stderr)
    res = {}
    for side in sides:
        r = res[side] = {}
        med = {c: statistics.median(times[c][side]) for c in cases}
        if "decode" in cases:
            r["decode_tokens_per_s"] = new_tokens / med["decode"]
            r["decode_wall_s"] = times["decode"][side]
        if "prefill" in cases:
            r["prefill_ttft_s"] = med["prefill"]
            r["prefill_wall_s"] = times["prefill"][side]
        if "batch" in cases:
            r["batch_tokens_per_s"] = batch * new_tokens / med["batch"]
            r["batch_wall_s"] = times["batch"][side]
        if "decode" in cases and "batch" in cases:
            r["batch_over_single"] = r["batch_tokens_per_s"] / r["decode_tokens_per_s"]
    out = {"workload": {"cases": list(cases), "new_tokens": new_tokens,
                        "prefill_tokens": prefill_tokens, "batch": batch,
                        "batch_prompt_tokens": batch_len,
                        "decode_prompt_tokens": len(decode_prompt), "repeats": repeats,
                        "seed": seed},
           "results": res}
    if peer is not None:
        ours, theirs = res["ours"], res["transformers"]
        ratios = {
            "decode_ours_over_transformers": ("decode_tokens_per_s", False),
            # > 1: our first token comes sooner
            "prefill_transformers_over_ours": ("prefill_ttft_s", True),
            "batch_ours_over_transformers": ("batch_tokens_per_s", False),
        }
        out["ratios"] = {name: (theirs[key] / ours[key] if inverse else ours[key] / theirs[key])
                         for name, (key, inverse) in ratios.items() if key in ours}
        if "decode" in cases:
            a, b = tokens[("decode", "ours")][0], tokens[("decode", "transformers")][0]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            out["greedy_tokens_agree"] = {"first_divergence": same, "of": len(a)}
    return out


def decode_breakdown(llm, prompt: list[int], steps: int = 20) -> dict:
    """Where one stream's decode time goes: the bare jitted step relaunched on a captured
    decode batch (device time plus dispatch), its LM head alone, and the per-token time of
    the whole generate (the rest is the engine's host work: scheduling, inputs, outputs)."""
    import jax
    import jax.numpy as jnp

    from nanojax.models.llama import LlamaForCausalLM
    runner = llm.engine.runner
    captured = []

    def capture(inputs, *rest, run=runner._run):  # rest: the runner's grammar-mask hook
        captured.append(inputs)
        return run(inputs, *rest)

    runner._run = capture  # on this instance only, for one generation
    try:
        t0 = time.perf_counter()
        _ours(llm, [prompt], steps)
        per_token = (time.perf_counter() - t0) / steps
    finally:
        del runner._run
    inputs = captured[-1]  # a decode step of one row
    t0 = time.perf_counter()
    for _ in range(steps):
        out = runner._run(inputs)
    jax.block_until_ready(out.tokens)
    step = (time.perf_counter() - t0) / steps
    fwd = runner.forward
    head = jax.jit(lambda p, x: fwd.model.apply(
        p["rest"] if "rest" in p else p, x, method=LlamaForCausalLM.logits))
    x = jnp.ones((1, llm.engine.model_config.hidden_size), jnp.float32)
    jax.block_until_ready(head(runner.params, x))
    t0 = time.perf_counter()
    for _ in range(steps):
        y = head(runner.params, x)
    jax.block_until_ready(y)
    lm_head = (time.perf_counter() - t0) / steps
    return {"generate_ms_per_token": 1e3 * per_token, "bare_step_ms": 1e3 * step,
            "lm_head_ms": 1e3 * lm_head, "layers_and_sampling_ms": 1e3 * (step - lm_head),
            "engine_host_ms_per_token": 1e3 * (per_token - step),
            "step_shapes": {"tokens": int(inputs.host_tokens.shape[0]),
                            "rows": int(inputs.meta.page_table.shape[0]),
                            "page_table_width": int(inputs.meta.page_table.shape[1])}}


def _engine_state(llm) -> dict:
    """The shapes our engine actually ran with (CPU defaults differ from the GPU's)."""
    import jax
    r, c = llm.engine.runner, llm.engine.config
    return {"b_dense": c.b_dense, "min_token_bucket": c.min_token_bucket,
            "token_bucket_step": c.token_bucket_step, "min_row_bucket": c.min_row_bucket,
            "fixed_shapes": r.fixed_shapes, "num_pages": llm.engine.sizing.num_pages,
            "forward": type(r.forward).__name__,
            "compiler_options": r.forward.compiler_options, "step_compiles": r.num_compiles,
            # GGUF blocks the engine kept (--cpu-weights q4): quantized tensors, steps of
            # up to quant_max_rows rows run from them
            "quantized_tensors": len(jax.tree_util.tree_leaves(
                r.params.get("quant", {}), is_leaf=lambda n: isinstance(n, dict) and "q" in n)),
            "quant_max_rows": getattr(r.forward, "quant_max_rows", None)}


def cmd_latency(args) -> int:
    import json

    from nanojax.config_flags import engine_config_from_args
    from nanojax.engine.llm import LLM
    from nanojax.errors import NanojaxError
    from nanojax.plugins import model_loader
    from nanojax.profiling.record import run_record, write_json

    cases = tuple(c for c in args.cases.split(",") if c)
    if not cases or set(cases) - set(CASES):
        raise NanojaxError(f"--cases takes some of {', '.join(CASES)} (comma-separated), "
                           f"got {args.cases!r}")
    threads = args.threads or len(os.sched_getaffinity(0))
    config = engine_config_from_args(args)
    bundle = model_loader().load_model(args.model, dtype="float32", cache_dir=args.cache_dir)
    gguf = args.peer_gguf or model_loader().gguf_file(args.model, args.cache_dir)
    if gguf is None and not args.no_peer:
        raise NanojaxError(f"the transformers peer needs the model's GGUF file: give "
                           f"--peer-gguf for {args.model!r}, or --no-peer")
    peer = None if args.no_peer else TransformersPeer(gguf, threads)
    forward = None
    if args.forward:  # another CPU forward than the default, for an A/B
        from nanojax.engine import forward as fwd
        forward = getattr(fwd, FORWARDS[args.forward])(bundle.config)
        forward.small_gemms = config.kernels.cpu_small_gemms  # read by layerwise only
    llm = LLM(bundle, config=config, forward=forward)
    prompt = bundle.tokenizer.encode(DECODE_PROMPT) if bundle.tokenizer else None
    out = run_latency(llm, peer, new_tokens=args.new_tokens,
                      prefill_tokens=args.prefill_tokens, batch=args.batch,
                      repeats=args.repeats, decode_prompt=prompt, seed=args.seed,
                      progress=not args.quiet, cases=cases)
    vocab = bundle.config.vocab_size
    breakdown = decode_breakdown(llm, prompt or _prompts(np.random.default_rng(args.seed),
                                                         vocab, 1, 16)[0])
    import torch
    payload = {**run_record(config), "model": args.model, "peer_gguf": str(gguf) if peer else None,
               "peer": peer.stack if peer else None,
               "threads": {"cpu_affinity": len(os.sched_getaffinity(0)),
                           "torch_num_threads": torch.get_num_threads(),
                           "jax": "XLA's CPU thread pool over every core of the affinity"},
               "engine": _engine_state(llm), "decode_breakdown": breakdown, **out}
    print(format_table(out), file=sys.stderr)
    print(json.dumps(out.get("ratios", {})))
    write_json(args.json, payload)
    return 0


def format_table(out: dict) -> str:
    res = out["results"]
    rows = [("decode tok/s (1 stream)", "decode_tokens_per_s", "{:.1f}"),
            ("prefill TTFT s", "prefill_ttft_s", "{:.2f}"),
            (f"batch {out['workload']['batch']} tok/s", "batch_tokens_per_s", "{:.1f}"),
            ("batch / single", "batch_over_single", "{:.2f}")]
    sides = list(res)
    lines = [f"{'':26}" + "".join(f"{s:>14}" for s in sides)]
    for label, key, fmt in rows:
        if key in res[sides[0]]:
            lines.append(f"{label:26}" + "".join(f"{fmt.format(res[s][key]):>14}"
                                                 for s in sides))
    for k, v in out.get("ratios", {}).items():
        lines.append(f"{k:40} {v:.2f}")
    return "\n".join(lines)


def register_latency(bsub) -> None:
    from nanojax.config_flags import add_engine_args, add_model_args
    p = bsub.add_parser("latency", help="CPU latency: one stream's decode, a long prompt's "
                                        "prefill and a small batch, against transformers")
    add_model_args(p)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=1500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"which measurements, comma-separated (default: {','.join(CASES)})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores this process may use, as XLA)")
    p.add_argument("--peer-gguf", default=None,
                   help="GGUF file transformers loads (default: the embedded model's)")
    p.add_argument("--no-peer", action="store_true", help="ours only")
    p.add_argument("--forward", choices=sorted(FORWARDS), default=None,
                   help="our step's forward (default: the engine's; on the CPU layerwise: "
                        "one jitted layer called per layer; scan: lax.scan over stacked "
                        "layers, which copies each layer's weights; unrolled: straight-line "
                        "layers, a longer compile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", default=None, help="write the full result here")
    add_engine_args(p)
    p.set_defaults(func=cmd_latency)
