"""`nanojax` command line: generate, convert, info, serve, bench, costmodel, profile, search."""
from __future__ import annotations

import argparse
import json
import sys
import time

from nanojax import plugins
from nanojax.config import QUANTIZATIONS, RANDOM_PREFIX
from nanojax.config_flags import (add_engine_args, add_model_args, engine_config_from_args,
                                  integer, non_negative_float, number, positive_int,
                                  token_ids_list)
from nanojax.errors import ConfigError, NanojaxError
from nanojax.pipeline.streams import add_stream_xla_flags


def _no_tokenizer(model: str) -> ConfigError:
    return ConfigError(f"{model} has no tokenizer: give the prompt as token ids, e.g. "
                       "--prompt-token-ids 1,2,3")


# generate's sampling where neither the flags nor the model's generation_config set it:
# greedy, so a bare `nanojax generate` is reproducible
GENERATE_FALLBACK = {"max_tokens": 64, "temperature": 0.0}
_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")


def _check_generate_args(args) -> dict:
    """What can be refused without the model is refused before its load (seconds).
    Returns the sampling fields the flags set."""
    from nanojax.engine.sampling import SamplingParams

    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise ConfigError("give either a prompt or --prompt-token-ids (one of them)")
    if args.prompt is not None and args.model.startswith(RANDOM_PREFIX):
        raise _no_tokenizer(args.model)  # random:<shape> models come without one
    given = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    SamplingParams(**{**GENERATE_FALLBACK, **given})  # refuses bad values before the load
    return given


def generate_sampling_params(given: dict, model_defaults: dict):
    """The flags, then the model's generation_config.json (as `serve` applies it to a
    request), then GENERATE_FALLBACK."""
    from nanojax.engine.sampling import SamplingParams
    return SamplingParams(**{**GENERATE_FALLBACK, **model_defaults, **given})


def _prompt(args, tokenizer):
    if args.prompt_token_ids is not None:
        return args.prompt_token_ids  # fed as they are, as vLLM's prompt_token_ids
    if tokenizer is None:
        raise _no_tokenizer(args.model)
    if args.no_chat_template:
        return args.prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])


def cmd_generate(args) -> int:
    from nanojax.engine.llm import LLM

    given = _check_generate_args(args)
    t0 = time.time()
    llm = LLM(model=args.model, dtype=args.dtype, cache_dir=args.cache_dir,
              quantization=args.quantization, config=engine_config_from_args(args),
              generation_config=args.generation_config)
    print(f"nanojax: loaded {args.model} in {time.time() - t0:.1f}s", file=sys.stderr)
    defaults = llm.sampling_defaults
    unset = {k: v for k, v in defaults.items() if k not in given}
    if unset:
        print(f"nanojax: sampling as the model's generation_config says: {unset} "
              "(flags override; --generation-config vllm: not)", file=sys.stderr)
    prompt = _prompt(args, llm.tokenizer)
    if "max_tokens" not in given:  # a default, not the user's: capped to the context's room
        n = len(prompt) if isinstance(prompt, list) else len(llm.tokenizer.encode(prompt))
        room = llm.engine.max_model_len - n
        cap = min(defaults.get("max_tokens", GENERATE_FALLBACK["max_tokens"]), room)
        defaults = {**defaults, "max_tokens": max(1, cap)}
    params = generate_sampling_params(given, defaults)
    t1 = time.time()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    dt = time.time() - t1
    print(f"nanojax: {len(out.token_ids)} tokens in {dt:.2f}s ({out.finish_reason})",
          file=sys.stderr)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason}))
    elif llm.tokenizer is None:  # no text to show: the ids, as --prompt-token-ids takes them
        print(",".join(map(str, out.token_ids)))
    else:
        print(out.text)
    return 0


def cmd_convert(args) -> int:
    calibration = None
    if args.calibration_data is not None:  # read before the weights: a bad file fails fast
        calibration = read_calibration_texts(args.calibration_data)
        if args.quantization != "fp8":
            raise SystemExit("nanojax: --calibration-data sets FP8 static activation "
                             "scales: give --quantization fp8 with it")
    dst = plugins.model_loader().convert(args.src, args.dst, dtype=args.dtype or "float32",
                                         overwrite=args.overwrite,
                                         quantization=args.quantization,
                                         calibration=calibration)
    print(f"nanojax: wrote {dst}", file=sys.stderr)
    return 0


def read_calibration_texts(path: str) -> list[str]:
    """Calibration samples: a .jsonl file of {"text": ...} objects, or plain text with one
    sample per line (blank lines skipped)."""
    from pathlib import Path
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"nanojax: --calibration-data: no file {path}")
    try:
        lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if p.suffix == ".jsonl":
            texts = [json.loads(ln)["text"] for ln in lines]
            if not all(isinstance(t, str) for t in texts):
                raise TypeError("a 'text' that is not a string")
        else:
            texts = lines
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise SystemExit(f"nanojax: --calibration-data {path}: {type(e).__name__}: {e} "
                         "(want one text per line, or .jsonl lines {\"text\": ...})") from None
    if not texts:
        raise SystemExit(f"nanojax: --calibration-data {path} holds no sample")
    for n, t in enumerate(texts, 1):  # a JSON escape can make a lone surrogate: no text
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise SystemExit(f"nanojax: --calibration-data {path}: sample {n} is not valid "
                             "Unicode (a lone surrogate)") from None
    return texts


def cmd_info(args) -> int:
    bundle = plugins.model_loader().load_model(
        args.model, dtype=args.dtype, cache_dir=args.cache_dir, quantization=args.quantization)
    cfg = bundle.config
    info = {"model": args.model, "quantization": cfg.quantization,
            "config": cfg.to_dict(), "parameters": cfg.param_count(),
            "active_parameters": cfg.active_param_count(),
            "kv_bytes_per_token": cfg.kv_bytes_per_token()}
    if bundle.tokenizer is not None:
        tok = bundle.tokenizer
        info["tokenizer"] = {"vocab_size": tok.vocab_size, "bos_token": tok.bos_token,
                             "eos_token_ids": list(tok.eos_token_ids),
                             "has_chat_template": bool(tok.chat_template)}
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanojax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default=None,
                   help="the prompt text (or give --prompt-token-ids)")
    g.add_argument("--prompt-token-ids", type=token_ids_list, default=None, metavar="IDS",
                   help="the prompt as comma-separated token ids (e.g. 1,2,3), fed raw; "
                        "random:<shape> models, which have no tokenizer, take only these")
    add_model_args(g)
    g.add_argument("--max-tokens", type=positive_int, default=None,
                   help="default: the model's generation_config, else 64")
    g.add_argument("--temperature", type=non_negative_float, default=None,
                   help="0 is greedy (default: the model's generation_config, else 0)")
    g.add_argument("--top-p", type=number, default=None)
    g.add_argument("--top-k", type=integer, default=None)
    g.add_argument("--min-p", type=number, default=None,
                   help="keep tokens at least this fraction of the likeliest's probability")
    g.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: sampling the flags leave unset comes from the model's "
                        "generation_config.json, as `serve` does; vllm: not")
    g.add_argument("--seed", type=integer, default=None)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt raw")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids) on stdout")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a GGUF file or HF directory to a nanojax "
                                       "(orbax) checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: store the dense projections in FP8 (e4m3, per output channel); "
                        "activations quantized per token at run time unless "
                        "--calibration-data is given. fp8-block: per 128 x 128 block")
    c.add_argument("--calibration-data", default=None, metavar="FILE",
                   help="with --quantization fp8: static activation scales (one per "
                        "projection, absmax / 448 of its inputs over these samples, cut to "
                        "512 tokens each), as llm-compressor's static FP8 recipe; one text "
                        "a line, or .jsonl lines {\"text\": ...}")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("info", help="print a model's config and parameter count")
    i.add_argument("model")
    i.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    i.add_argument("--cache-dir", default=None)
    i.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="as generate/serve take it: show the model quantized")
    i.set_defaults(func=cmd_info)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands that live next to their subsystem: bench and serve here, then those
    installed as plugins (search's costmodel, profile and search: nanojax/plugins.py)."""
    from nanojax.bench.cli import register as bench
    from nanojax.server.cli import register as serve
    return [bench, serve, *plugins.commands()]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    add_stream_xla_flags()
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in
                                  ("throughput", "serve", "step", "schedule", "host", "latency",
                                   "plot-timeline", "hlo-schedule", "-h", "--help")):
        argv.insert(1, "throughput")  # `nanojax bench` is the offline benchmark
    args = build_parser().parse_args(argv)
    try:
        from nanojax.config_flags import apply_gpu_memory_utilization
        apply_gpu_memory_utilization(args)
        if hasattr(args, "no_compile_cache"):  # commands that compile: cache what they do
            from nanojax import compile_cache
            compile_cache.configure(args)
        return args.func(args)
    except NanojaxError as e:
        print(f"nanojax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
