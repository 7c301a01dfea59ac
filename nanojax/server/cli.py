"""`nanojax serve`: load a model, start the engine thread, serve the OpenAI API."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time


def build_engine(args, bundle):
    """The LLMEngine `nanojax serve` runs: its forward from --plan, shapes compiled before
    listening with --compile-at-start."""
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.pipeline.choose import choose_plan

    log = logging.getLogger("nanojax.server")
    plan, why = choose_plan(args.plan, bundle.config, args.b_dense)
    log.info("%s", why)
    forward = None
    if plan is not None:
        from nanojax.pipeline.executor import PipelineForward
        forward = PipelineForward(bundle.config, plan, args.plan_mode)
    compile_at_start = args.compile_at_start
    if compile_at_start is None:  # on a GPU: a 32-layer step compiles in ~7 s
        import jax
        compile_at_start = jax.default_backend() == "gpu"
    engine = LLMEngine(bundle, EngineConfig(
        b_dense=args.b_dense, num_pages=args.num_pages, page_size=args.page_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        admission=args.admission, fixed_shapes=compile_at_start), forward=forward)
    if compile_at_start:  # no request waits on a compile once the port is open
        t0 = time.monotonic()
        n = engine.runner.warmup(progress=True)
        print(f"nanojax: compiled {n} step shapes in {time.monotonic() - t0:.1f}s",
              file=sys.stderr, flush=True)
    return engine


def cmd_serve(args) -> int:
    from aiohttp import web

    from checkpoints.loader import load_model
    from nanojax.engine.async_engine import AsyncLLMEngine
    from nanojax.server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bundle = load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    engine = build_engine(args, bundle)
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

    app = build_app(aeng, name, api_key=args.api_key, max_body=args.max_body,
                    max_waiting=args.max_waiting, on_engine_death=engine_died)

    async def drain(_app):
        """SIGTERM: let in-flight requests finish for a while, then abort the rest."""
        deadline = time.monotonic() + args.drain_timeout
        while aeng.num_pending and aeng.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, aeng.shutdown)

    app.on_shutdown.append(drain)
    print(f"nanojax: serving {name} on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                shutdown_timeout=args.drain_timeout + 5, print=None,
                access_log=None if args.no_access_log else logging.getLogger("aiohttp"))
    return status["exit"]


def register(sub) -> None:
    from nanojax.cli import _add_model_args
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--b-dense", type=int, default=256)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--num-pages", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--admission", choices=["greedy", "predicted"], default="greedy",
                   help="predicted: NanoFlow's memory-usage prediction at admission")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--compile-at-start", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="fix the row count and page-table width and compile every step "
                        "shape before listening (one per token bucket), so no request "
                        "waits on a compile; default: on a GPU (a 32-layer step compiles "
                        "in ~7 s there), off on the CPU (fixed rows cost logits per row)")
    s.add_argument("--plan", default=None,
                   help="run the nano-batch executor with this plan: a shipped plan's name, "
                        "a JSON path, or 'auto' (the shipped plan matching the model, on a "
                        "GPU; none if no plan matches); resized to --b-dense if needed")
    s.add_argument("--plan-mode", choices=["overlap", "nanobatch-only", "non-overlap"],
                   default="overlap", help="with --plan: the plan as searched, or an ablation")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="engine requests (prompts x n) allowed to wait; a request that "
                        "would go beyond it: 503 (400 if it alone exceeds it)")
    s.add_argument("--max-body", type=int, default=1 << 20, help="bytes; beyond it: 413")
    s.add_argument("--drain-timeout", type=float, default=5.0)
    s.add_argument("--no-access-log", action="store_true")
    s.set_defaults(func=cmd_serve)
