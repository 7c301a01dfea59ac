"""The engine loop runs with the start-up objects frozen out of gc's scans, and leaves
them unfrozen when it ends or idles (nanojax/engine/gc_freeze.py)."""
import gc
import time
import weakref

from nanojax.config import EngineConfig
from nanojax.engine.async_engine import AsyncLLMEngine
from nanojax.engine.gc_freeze import FrozenWhileBusy, frozen_startup_objects
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.sampling import SamplingParams


def test_holds_nest_and_the_last_release_unfreezes():
    assert gc.get_freeze_count() == 0
    a, b = FrozenWhileBusy(), FrozenWhileBusy()
    a.hold()
    a.hold()                                  # idempotent
    assert gc.get_freeze_count() > 0
    b.hold()
    a.release()
    assert gc.get_freeze_count() > 0          # b still holds
    with frozen_startup_objects():
        pass
    assert gc.get_freeze_count() > 0
    b.release()
    b.release()
    assert gc.get_freeze_count() == 0


def test_a_frozen_cycle_is_collected_after_the_loop():
    class Node:
        pass
    n = Node()
    n.self = n                                # garbage only a full collection frees
    ref = weakref.ref(n)
    with frozen_startup_objects():
        del n
        gc.collect()
        assert ref() is not None              # frozen: not scanned
    gc.collect()
    assert ref() is None


def test_engine_loops_freeze_while_busy_only(tiny_bundle):
    eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, page_size=4, num_pages=64,
                                              max_model_len=32))
    seen = []
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    step = eng.step
    eng.step = lambda: (seen.append(gc.get_freeze_count()), step())[1]
    eng.run_to_completion()
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0

    served = AsyncLLMEngine(LLMEngine(tiny_bundle, EngineConfig(
        b_dense=32, page_size=4, num_pages=64, max_model_len=32)))
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and gc.get_freeze_count():
            time.sleep(0.01)
        assert gc.get_freeze_count() == 0     # an idle server keeps nothing frozen
    finally:
        served.shutdown()
