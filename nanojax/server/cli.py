"""`nanojax serve`: load a model, start the engine thread, serve the OpenAI API."""
from __future__ import annotations

import asyncio
import logging
import sys
import time

from nanojax.config_flags import add_engine_args, add_model_args, engine_config_from_args


def cmd_serve(args) -> int:
    from aiohttp import web

    from checkpoints.loader import load_model
    from nanojax.engine.async_engine import AsyncLLMEngine
    from nanojax.engine.llm_engine import LLMEngine
    from nanojax.server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = engine_config_from_args(args)
    bundle = load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    engine = LLMEngine(bundle, config)
    if engine.runner.fixed_shapes:  # no request waits on a compile once the port is open
        n = engine.runner.warmup()
        if engine.offloader is not None:  # the KV offload's page copies too
            n += engine.offloader.warmup()
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
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(s)
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait; beyond it: 503")
    s.add_argument("--max-body", type=int, default=1 << 20, help="bytes; beyond it: 413")
    s.add_argument("--drain-timeout", type=float, default=5.0)
    s.add_argument("--no-access-log", action="store_true")
    s.set_defaults(func=cmd_serve)
