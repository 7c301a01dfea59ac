"""Python's garbage collector while the engine loop runs.

A full (oldest-generation) collection scans every tracked object in the process: jax's,
flax's, the tokenizer's and the engine's own, hundreds of thousands of them, for a pause
of tens to hundreds of milliseconds on the engine thread, during which the device runs
out of launched work. The loop allocates steadily (outputs, records, token lists), so
such collections recur through a run. `frozen_startup_objects` moves every object that
exists when the loop starts into the collector's permanent generation (gc.freeze), so
collections during the loop scan only what the loop created, and back out when the loop
ends (gc.unfreeze), so a later collection can still free an engine that is gone (the
benchmark builds one engine per mode in one process). vLLM freezes after start-up too.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time

_lock = threading.Lock()
_holders = 0  # loops running now (nested or in other threads): the last one unfreezes


class FrozenWhileBusy:
    """One loop's hold on the freeze: `hold` while it has work, `release` when it goes
    idle or ends (a server idles for hours: its garbage must not wait for the next
    request). Both are idempotent."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # False: holds nothing (EngineConfig.gc_freeze)
        self._held = False

    def hold(self) -> None:
        global _holders
        if self._held or not self.enabled:
            return
        with _lock:
            if _holders == 0:
                gc.freeze()
            _holders += 1
        self._held = True

    def release(self) -> None:
        global _holders
        if not self._held:
            return
        with _lock:
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()
        self._held = False


@contextlib.contextmanager
def frozen_startup_objects(enabled: bool = True):
    hold = FrozenWhileBusy(enabled)
    hold.hold()
    try:
        yield
    finally:
        hold.release()


class GcPauses:
    """Counts the collector's runs and pauses while active (a context manager), per
    generation: what the loop still pays with the freeze, for the benchmark's report."""

    def __init__(self):
        self.runs = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = 0.0
        self._t = 0.0

    def _callback(self, phase, info) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        d = time.perf_counter() - self._t
        g = info["generation"]
        self.runs[g] += 1
        self.pause_s[g] += d
        self.max_pause_s = max(self.max_pause_s, d)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def report(self) -> dict:
        return {"runs_by_generation": list(self.runs),
                "pause_ms_by_generation": [round(1e3 * p, 3) for p in self.pause_s],
                "max_pause_ms": round(1e3 * self.max_pause_s, 3)}
