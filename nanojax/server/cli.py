"""`nanojax serve`: load a model, start the engine thread, serve the OpenAI API."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from nanojax.config_flags import (add_engine_args, add_model_args, engine_config_from_args,
                                  integer, non_negative_float, positive_int)


def configure_logging() -> None:
    """nanojax's and the access log's INFO lines; everyone else's warnings and errors only:
    at INFO, jax logs its failed libtpu probe and orbax (through absl) a dozen lines per
    checkpoint load, which buried the server's own first lines."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in ("nanojax", "aiohttp"):
        logging.getLogger(name).setLevel(logging.INFO)


def build_engine(args, bundle):
    """The LLMEngine `nanojax serve` runs, with its forward from --plan, and the record of
    that choice (for /server_info)."""
    from nanojax.engine.llm_engine import LLMEngine
    from nanojax.pipeline.choose import choose_plan

    config = engine_config_from_args(args)
    log = logging.getLogger("nanojax.server")
    plan, why = choose_plan(args.plan, bundle.config, config.dense_batch())
    log.info("%s", why)
    forward = None
    if plan is not None:  # the engine runs the plan's dense batch
        config = config.replace(b_dense=config.dense_batch())
        from nanojax.pipeline.executor import PipelineForward
        forward = PipelineForward(bundle.config, plan, args.plan_mode, kernels=config.kernels,
                                  tp=config.tensor_parallel_size)
    chosen = {"plan": why, "plan_mode": args.plan_mode if plan is not None else None,
              "plan_json": plan}
    return LLMEngine(bundle, config, forward=forward), chosen


def warm_up(engine) -> None:
    """With fixed shapes (the default on a GPU), every step shape compiled before the
    port opens, so no request waits on a compile."""
    if engine.runner.fixed_shapes:
        t0 = time.monotonic()
        loaded = engine.runner.num_loaded
        n = engine.runner.warmup(progress=True)
        loaded = engine.runner.num_loaded - loaded
        if engine.offloader is not None:  # the KV offload's page copies too
            n += engine.offloader.warmup()
        print(f"nanojax: compiled {n} step shapes, loaded {loaded} from the step cache, "
              f"in {time.monotonic() - t0:.1f}s",
              file=sys.stderr, flush=True)
        left = (engine.runner.warmup_memory or {}).get("pages_left_at_peak")
        if left:  # the fixed reserve for XLA's buffers took more than they did
            from nanojax.engine.kv_cache import headroom_line
            print(f"nanojax: {headroom_line(engine.runner.num_pages, left)}",
                  file=sys.stderr, flush=True)


def cmd_serve(args) -> int:
    from aiohttp import web

    from nanojax.engine.async_engine import AsyncLLMEngine
    from nanojax.plugins import model_loader
    from nanojax.profiling.record import run_record
    from nanojax.server.app import build_app

    from nanojax.parallel.multihost import init_distributed, is_leader
    configure_logging()
    init_distributed(args)
    bundle = model_loader().load_model(
        args.model, dtype=args.dtype, cache_dir=args.cache_dir,
        tensor_parallel_size=engine_config_from_args(args).tensor_parallel_size,
        quantization=args.quantization)
    engine, chosen = build_engine(args, bundle)
    if not is_leader():  # process 0 serves; this one runs its steps until it stops
        n = engine.runner.follow()
        print(f"nanojax: process 0 stopped after {n} steps", file=sys.stderr)
        return 0
    warm_up(engine)
    aeng = AsyncLLMEngine(engine)
    name = args.served_model_name or args.model
    status = {"exit": 0}

    def engine_died(err: BaseException) -> None:
        """The engine cannot go on: stop serving and exit non-zero, so that a supervisor
        restarts the server (run_app's SIGTERM handler shuts it down)."""
        print(f"nanojax: the engine failed ({type(err).__name__}: {err}); exiting with "
              "status 1", file=sys.stderr, flush=True)
        status["exit"] = 1
        signal.raise_signal(signal.SIGTERM)

    defaults = bundle.sampling_defaults if args.generation_config == "auto" else {}
    if defaults:
        print(f"nanojax: requests that leave them unset get the model's generation_config "
              f"sampling {defaults} (--generation-config vllm: not)", file=sys.stderr)
    record = run_record(engine.config, bundle.config)
    if args.api_key:  # the record lands in benchmark results: never the key
        record["command"] = record["command"].replace(args.api_key, "<api-key>")
    app = build_app(aeng, name, api_key=args.api_key, max_body=args.max_body,
                    max_waiting=args.max_waiting, on_engine_death=engine_died,
                    server_info={**record, **chosen,
                                 "reasoning_parser": args.reasoning_parser,
                                 "sampling_defaults": defaults},
                    reasoning_parser=args.reasoning_parser, sampling_defaults=defaults)

    async def drain(_app):
        """SIGTERM: let in-flight requests finish for a while, then abort the rest."""
        deadline = time.monotonic() + args.drain_timeout
        while aeng.num_pending and aeng.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, aeng.shutdown)
        engine.runner.stop_followers()

    app.on_shutdown.append(drain)
    print(f"nanojax: serving {name} on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                shutdown_timeout=args.drain_timeout + 5, print=None,
                access_log=None if args.no_access_log else logging.getLogger("aiohttp"))
    return status["exit"]


def register(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(s)
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=integer, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--plan", default=None,
                   help="run the nano-batch executor with this plan: a shipped plan's name, "
                        "a JSON path, or 'auto' (the shipped plan matching the model, on a "
                        "GPU; none if no plan matches); resized to --b-dense if needed")
    s.add_argument("--plan-mode", choices=["overlap", "nanobatch-only", "non-overlap"],
                   default="overlap", help="with --plan: the plan as searched, or an ablation")
    s.add_argument("--max-waiting", type=integer, default=256,
                   help="engine requests (prompts x n) allowed to wait; a request that "
                        "would go beyond it: 503 (400 if it alone exceeds it) "
                        "(default: %(default)s)")
    s.add_argument("--max-body", type=positive_int, default=1 << 20,
                   help="bytes; beyond it: 413 (default: %(default)s)")
    s.add_argument("--drain-timeout", type=non_negative_float, default=5.0,
                   help="seconds that in-flight requests get to finish on SIGTERM before "
                        "they are aborted (default: %(default)s)")
    s.add_argument("--no-access-log", action="store_true")
    s.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: the model's generation_config.json sampling (temperature, "
                        "top_p, top_k, min_p, repetition_penalty) for requests that leave them "
                        "unset, as vLLM's default; vllm: the API's own defaults "
                        "(default: %(default)s)")
    from nanojax.server.reasoning import PARSERS
    s.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="chat completions: the <think> block of a reasoning model (Qwen3, "
                        "DeepSeek-R1) as message.reasoning_content, the rest as content, as "
                        "vLLM's flag of the name (default: no split)")
    from nanojax.parallel.multihost import add_distributed_args
    add_distributed_args(s)
    s.set_defaults(func=cmd_serve)
