"""Online API: the engine loop on a background thread, requests as async streams.

    engine = AsyncLLMEngine(LLMEngine(...))
    async for out in engine.generate(prompt, SamplingParams(...), request_id="r1"):
        ...                      # RequestOutput with delta_text / delta_token_ids
    await engine.abort("r1")     # also done when the consumer stops iterating

Requests are validated on the caller's side, so a bad request raises at once; the engine
thread owns the scheduler and is the only one that touches it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import time
import traceback
from typing import AsyncIterator

from nanojax.engine.gc_freeze import FrozenWhileBusy
from nanojax.engine.llm_engine import LLMEngine, RequestError
from nanojax.engine.outputs import RequestOutput
from nanojax.engine.sampling import SamplingParams
from nanojax.errors import EngineDeadError


@dataclasses.dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting = max_waiting
        self._streams: dict[str, _Stream] = {}
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.on_step = None  # optional callback(outputs, engine) run on the engine thread
        self._thread = threading.Thread(target=self._run, name="nanojax-engine", daemon=True)
        self._thread.start()

    # ---- health --------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stop

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop died; None while it runs or after a clean shutdown."""
        if self._error is None and not self._stop and not self._thread.is_alive():
            return RuntimeError("the engine thread ended")
        return self._error

    @property
    def num_pending(self) -> int:
        """Requests accepted but not finished (running, waiting or queued to add)."""
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass prompt token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        ids = self.encode(prompt)
        self.engine.check_prompt(ids, params)
        request_id = request_id or f"areq-{next(self._ids)}"
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), time.monotonic())
        with self._lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._submit(("add", request_id, ids, params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # consumer went away (client disconnect, cancellation)
                self._submit(("abort", request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def _submit(self, command) -> None:
        self._commands.append(command)
        self._wake.set()

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        frozen = FrozenWhileBusy(eng.config.gc_freeze)
        try:
            self._loop(eng, frozen)
        except BaseException as e:  # the engine is dead: fail every open stream
            self._error = e
            traceback.print_exc()
            err = EngineDeadError(f"engine failed: {type(e).__name__}: {e}")
            for rid in list(self._streams):
                self._deliver(rid, err)
        finally:
            frozen.release()

    def _loop(self, eng, frozen: FrozenWhileBusy) -> None:
        while not self._stop:
            self._drain_commands()
            if eng.is_idle:
                frozen.release()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            frozen.hold()  # gc: see nanojax/engine/gc_freeze.py
            outputs = eng.step()
            if self.on_step is not None:
                self.on_step(outputs, eng)
            self._deliver_step(outputs)

    def _drain_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                _, rid, ids, params = cmd
                if rid in self._streams:
                    try:
                        self.engine.add_request(ids, params, request_id=rid)
                    except Exception as e:
                        self._deliver(rid, e)
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # its event loop is closed
                pass

    def _deliver_step(self, outputs) -> None:
        """A step's outputs, one wake-up per event loop (call_soon_threadsafe writes to
        the loop's self-pipe: one syscall a call, not one a request)."""
        by_loop: dict = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop is closed
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left and stop the loop."""
        for rid in list(self._streams):
            self._submit(("abort", rid))
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_alive:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)
