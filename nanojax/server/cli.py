"""`nanojax serve`: load a model, start the engine thread, serve the OpenAI API."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time


def cmd_serve(args) -> int:
    from aiohttp import web

    from checkpoints.loader import load_model
    from nanojax.engine.async_engine import AsyncLLMEngine
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bundle = load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    compile_at_start = args.compile_at_start
    if compile_at_start is None:  # on a GPU: a 32-layer step compiles in ~7 s
        import jax
        compile_at_start = jax.default_backend() == "gpu"
    engine = LLMEngine(bundle, EngineConfig(
        b_dense=args.b_dense, num_pages=args.num_pages, page_size=args.page_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        admission=args.admission, fixed_shapes=compile_at_start,
        kv_cache_dtype=args.kv_cache_dtype))
    if compile_at_start:  # no request waits on a compile once the port is open
        n = engine.runner.warmup()
        print(f"nanojax: compiled {n} step shapes", file=sys.stderr, flush=True)
    aeng = AsyncLLMEngine(engine)
    name = args.served_model_name or args.model
    app = build_app(aeng, name, api_key=args.api_key, max_body=args.max_body,
                    max_waiting=args.max_waiting)

    async def drain(_app):
        """SIGTERM: let in-flight requests finish for a while, then abort the rest."""
        deadline = time.monotonic() + args.drain_timeout
        while aeng.num_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, aeng.shutdown)

    app.on_shutdown.append(drain)
    print(f"nanojax: serving {name} on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                shutdown_timeout=args.drain_timeout + 5, print=None,
                access_log=None if args.no_access_log else logging.getLogger("aiohttp"))
    return 0


def register(sub) -> None:
    from nanojax.cli import _add_model_args, add_kv_cache_dtype_arg
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(s)
    add_kv_cache_dtype_arg(s)
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
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait; beyond it: 503")
    s.add_argument("--max-body", type=int, default=1 << 20, help="bytes; beyond it: 413")
    s.add_argument("--drain-timeout", type=float, default=5.0)
    s.add_argument("--no-access-log", action="store_true")
    s.set_defaults(func=cmd_serve)
