"""The engine around the stand-in model (engine/mock_forward.py), where the model is beside
the point: scheduling, chunked prefill, paging, preemption, prefix caching, async
scheduling and aborts. The mock's greedy output is known in advance (`mock_outputs`),
whatever a request is batched with, so every request's tokens are checked exactly; the
mock writes each token into its KV slot, so the cache's pages are checked too."""
import dataclasses

import jax
import numpy as np
import pytest

from nanojax.config import EngineConfig, named_shape
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.mock_forward import MockForward, mock_outputs, mock_params
from nanojax.engine.sampling import SamplingParams
from nanojax.models.bundle import ModelBundle

VOCAB = 64
CFG = dataclasses.replace(named_shape("tiny"), vocab_size=VOCAB)
PAGE = 4
# b_dense 32 with prompts up to 40 tokens: long prompts are prefilled in chunks
BASE = dict(b_dense=32, page_size=PAGE, num_pages=96, max_model_len=128, max_num_seqs=8,
            step_cache=False)


def _engine(**kw) -> LLMEngine:
    return LLMEngine(ModelBundle(CFG, mock_params(CFG.num_layers), None),
                     EngineConfig(**{**BASE, **kw}), forward=MockForward(CFG))


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def _workload(seed: int, n: int, max_prompt: int = 40, max_out: int = 30):
    """n (prompt, max_tokens) pairs of mixed lengths (1-token prompts and 1-token outputs
    included)."""
    rng = np.random.default_rng(seed)
    out = [([int(rng.integers(VOCAB))], 1), (rng.integers(0, VOCAB, max_prompt).tolist(),
                                             max_out)]
    for _ in range(n - 2):
        out.append((rng.integers(0, VOCAB, int(rng.integers(1, max_prompt + 1))).tolist(),
                    int(rng.integers(1, max_out + 1))))
    return out


def _run(eng: LLMEngine, work, check_kv: bool = False) -> dict:
    """Adds the requests, steps to the end (checking the cache's pages after every step
    with check_kv) and asserts each output is the mock's."""
    ids = {eng.add_request(p, _greedy(m)): (p, m) for p, m in work}
    done, steps = {}, 0
    while not eng.is_idle:
        for out in eng.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
        if check_kv:
            _assert_kv_holds_tokens(eng)
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    assert set(done) == set(ids)
    for rid, (p, m) in ids.items():
        assert done[rid].token_ids == mock_outputs(p, m, VOCAB), rid
        assert done[rid].finish_reason == "length"
    return done


def _assert_no_leaks(eng: LLMEngine) -> None:
    a = eng.allocator
    a.check_consistent()
    assert a.num_used == 0 and a.num_free == a.num_pages
    assert all(c == 0 for c in a.refcount)
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.requests
    assert len(eng.runner.page_tables) == 0  # every finished request gave its row back


def _assert_kv_holds_tokens(eng: LLMEngine) -> None:
    """Every running sequence's cache slots hold its tokens (the mock writes the token
    itself as its 'KV'), in every layer, for the tokens whose KV is written and whose value
    the host knows (with async scheduling, the newest may still be on the device)."""
    eng.runner.wait_dispatched()  # async_dispatch: the launched step is in runner.kv
    kv = [np.asarray(layer) for layer in eng.runner.kv]
    for seq in eng.scheduler.running:
        n = min(seq.num_computed, seq.num_known)
        want = np.array([seq.token_at(i) for i in range(n)], np.int32)
        pages = np.array([seq.pages[i // PAGE] for i in range(n)], np.int64)
        offsets = np.arange(n) % PAGE
        for layer in kv:
            np.testing.assert_array_equal(layer[pages, 0, offsets, 0], want,
                                          err_msg=f"{seq.request_id}'s pages")


@pytest.mark.parametrize("opts", [
    dict(async_scheduling=True),
    dict(async_scheduling=False),
    dict(async_scheduling=True, enable_prefix_caching=False),
    dict(async_scheduling=True, async_dispatch=True),
], ids=["async", "sync", "async-no-prefix-cache", "async-dispatch"])
def test_greedy_outputs_are_the_mock_outputs(opts):
    eng = _engine(num_pages=160, **opts)  # 8 running of up to 18 pages each: no preemption
    _run(eng, _workload(0, 14), check_kv=True)
    assert eng.scheduler.num_preemptions == 0  # the cache holds them all: plain batching
    _assert_no_leaks(eng)


def test_prefix_cache_hits_give_the_same_tokens():
    eng = _engine()
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, VOCAB, 33).tolist()  # 8 full pages and a token
    first = prefix + rng.integers(0, VOCAB, 5).tolist()
    second = prefix + rng.integers(0, VOCAB, 7).tolist()
    _run(eng, [(first, 10)])
    assert eng.prefix_cache.stats.hits == 0
    computed = eng.stats.prompt_tokens
    _run(eng, [(second, 12)], check_kv=True)
    hits = eng.prefix_cache.stats.hits
    assert hits >= 32 and hits % PAGE == 0  # the shared prefix's full pages at least
    # only what was not found in the cache ran through the model
    assert eng.stats.prompt_tokens - computed == len(second) - hits
    # the same prompt again: all but the pages its last token needs come from the cache
    _run(eng, [(second, 3)])
    assert eng.prefix_cache.stats.hits - hits == (len(second) - 1) // PAGE * PAGE
    _assert_no_leaks(eng)
    assert eng.allocator.num_cached > 0  # cached pages stay, yet count as free


def test_shared_prefix_running_together():
    """Requests sharing a prefix in one batch: the later ones find the first one's pages
    while it still runs (shared pages, refcount > 1), and every output is still exact."""
    eng = _engine(max_num_seqs=4)
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, VOCAB, 24).tolist()
    work = [(prefix + rng.integers(0, VOCAB, k).tolist(), 15) for k in (1, 3, 6, 9, 2, 5)]
    rid0 = eng.add_request(work[0][0], _greedy(work[0][1]))
    for _ in range(3):  # the first one's prefix is computed and registered
        eng.step()
    shared = []
    ids = {rid0: work[0]}
    ids.update({eng.add_request(p, _greedy(m)): (p, m) for p, m in work[1:]})
    done = {}
    while not eng.is_idle:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        shared.append(any(c > 1 for c in eng.allocator.refcount))
        _assert_kv_holds_tokens(eng)
    for rid, (p, m) in ids.items():
        assert done[rid].token_ids == mock_outputs(p, m, VOCAB)
    assert any(shared) and eng.prefix_cache.stats.hits >= 5 * 24
    _assert_no_leaks(eng)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_preemption_keeps_outputs_exact(async_scheduling, prefix_caching):
    # 14 pages of 4 tokens for 6 requests that grow to 28-40 tokens (7-10 pages) each:
    # greedy admission fills the cache with prompts, then running requests are preempted
    # and recomputed
    eng = _engine(num_pages=14, max_num_seqs=6, max_model_len=48,
                  async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    rng = np.random.default_rng(3)
    work = [(rng.integers(0, VOCAB, int(rng.integers(6, 13))).tolist(), 24) for _ in range(6)]
    _run(eng, work, check_kv=True)
    assert eng.scheduler.num_preemptions > 0
    _assert_no_leaks(eng)


def test_fixed_shapes_and_constant_batch_compile_only_at_warmup():
    eng = _engine(fixed_shapes=True, constant_batch=True)
    assert eng.runner.warmup() > 0
    compiled = eng.runner.num_compiles
    _run(eng, _workload(4, 10), check_kv=True)
    assert eng.runner.num_compiles == compiled, "a step shape compiled while serving"
    _assert_no_leaks(eng)


@pytest.mark.parametrize("row_shapes", [1, 2])
def test_fixed_shapes_compile_the_full_step_at_fewer_rows_too(row_shapes):
    """With fixed shapes the B_dense step is also compiled at 5/8 of the rows (its LM
    head and sampler then run on those): warmup compiles it, steps of few rows run it,
    nothing compiles mid-run, and the tokens are the mock's either way."""
    eng = _engine(fixed_shapes=True, b_dense=256, max_num_seqs=256, num_pages=2048,
                  full_step_row_shapes=row_shapes)
    runner = eng.runner
    assert runner.row_shapes(256) == ([192, 256] if row_shapes == 2 else [256])
    assert runner.row_shapes(128) == [256]
    assert runner.warmup() == len(runner.token_buckets()) + row_shapes - 1
    compiled, used = runner.num_compiles, []
    shapes_for = runner.shapes_for
    runner.shapes_for = lambda b, rows=None: used.append(shapes_for(b, rows)) or used[-1]
    _run(eng, _workload(5, 400, max_prompt=20, max_out=60), check_kv=True)
    assert runner.num_compiles == compiled, "a step shape compiled while serving"
    full = {r for t, r, _ in used if t == 256}
    assert full == ({192, 256} if row_shapes == 2 else {256}), used
    _assert_no_leaks(eng)


def test_running_out_of_device_memory_in_the_warm_up_is_a_clear_error():
    """An H100 ran out of memory in the warm-up's sampler at 2,048 rows (fp8.md §91) and
    the CLI printed XLA's traceback: it is now a ConfigError naming the cache's size and
    the flags that help. Other runtime errors pass through unchanged."""
    from nanojax.errors import ConfigError
    eng = _engine(fixed_shapes=True, b_dense=64, max_num_seqs=16, num_pages=256)
    runner = eng.runner

    def out_of_memory(*a, **k):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6.85GiB with "
            "allocator GPU_0_bfc on device 0.\nmore detail")
    runner.launch = out_of_memory
    with pytest.raises(ConfigError, match=r"out of memory .*6\.85GiB.*KV cache's .* GB"
                                          r".*64 tokens.*--num-pages"):
        runner.warmup()

    def other(*a, **k):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
    runner.launch = other
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        runner.warmup()


def test_the_warm_up_records_the_memory_peak_after_each_phase(monkeypatch):
    """The device's memory (a 7.4 GB peak over what was in use at 2,048 rows on an H100,
    fp8.md §92) is read after the step shapes and again after the sampler variants, so a
    run's JSON says which phase raised the peak; on a backend without memory counts (the
    CPU) nothing is recorded."""
    from nanojax.engine import runner as runner_mod
    eng = _engine(fixed_shapes=True, b_dense=64, max_num_seqs=16, num_pages=256)
    runner = eng.runner
    runner.warmup()
    assert runner.warmup_memory is None  # (the CPU keeps no count)
    phases = []
    real_samplers = runner._warm_samplers

    def samplers(*a, **k):
        phases.append("samplers")
        return real_samplers(*a, **k)

    def fake_memory():
        phases.append("read")
        peak = 100 * len(phases)
        return {"peak_bytes_in_use": peak, "bytes_in_use": 50, "bytes_limit": 10 ** 6}
    monkeypatch.setattr(runner_mod, "device_memory", fake_memory)
    monkeypatch.setattr(runner, "_warm_samplers", samplers)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")  # the pool: the engine's share
    runner.warmup()
    assert phases == ["read", "samplers", "read"]
    # the pages the share could still have held at the peak: the mock's page is one int32
    # a token a layer (a hint for --num-pages: H100 runs peaked ~5.5 GB under their share)
    page_bytes = CFG.num_layers * BASE["page_size"] * 4
    assert runner.warmup_memory == {
        "after_step_shapes": {"peak_bytes_in_use": 100, "bytes_in_use": 50,
                              "bytes_limit": 10 ** 6},
        "after_samplers": {"peak_bytes_in_use": 300, "bytes_in_use": 50,
                           "bytes_limit": 10 ** 6},
        "pages_left_at_peak": (10 ** 6 - 300) // page_bytes}
    runner.config = dataclasses.replace(runner.config, memory_utilization=0.0002)
    phases.clear()
    runner.warmup()  # a share (222 bytes) the peak (300) passed: none left
    assert runner.warmup_memory["pages_left_at_peak"] == 0


def test_serve_start_says_how_many_more_pages_would_have_fit(monkeypatch, capsys):
    """The server's warm-up says how many more KV pages its memory share had room for at
    the peak (fp8.md §97: ~5,000 on an H100, where a tenth of the share is held back for
    XLA's buffers); nothing when the peak used it all."""
    from nanojax.engine import runner as runner_mod
    from nanojax.server.cli import warm_up
    eng = _engine(fixed_shapes=True, b_dense=64, max_num_seqs=16, num_pages=256)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    page = CFG.num_layers * PAGE * 4  # the mock's page: an int32 a token a layer
    limit = [1000 + 10 * page + page // 2]
    monkeypatch.setattr(runner_mod, "device_memory", lambda: {
        "peak_bytes_in_use": 1000, "bytes_in_use": 500, "bytes_limit": limit[0]})
    warm_up(eng)
    assert "KV cache 256 pages; the warm-up's memory peak left room for 10 more" in \
        capsys.readouterr().err
    limit[0] = 1000
    warm_up(eng)
    assert "room for" not in capsys.readouterr().err


def test_abort_frees_pages_and_spares_the_others():
    eng = _engine(enable_prefix_caching=False, max_num_seqs=3)
    rng = np.random.default_rng(5)
    work = [(rng.integers(0, VOCAB, 9).tolist(), 20) for _ in range(5)]
    ids = [eng.add_request(p, _greedy(m)) for p, m in work]
    for _ in range(4):
        eng.step()
    running, waiting = eng.requests[ids[1]], eng.requests[ids[4]]
    assert running in eng.scheduler.running and running.output_ids
    assert waiting in eng.scheduler.waiting
    pages, used = list(running.pages), eng.allocator.num_used
    assert pages
    assert eng.abort_request(ids[1]) and eng.abort_request(ids[4])
    assert not eng.abort_request(ids[1])  # once only
    assert all(eng.allocator.is_free(p) for p in pages)
    assert eng.allocator.num_used == used - len(pages)
    eng.allocator.check_consistent()
    done = {}
    for out in eng.step():  # the aborted ones' last outputs come with the next step
        done[out.request_id] = out
    assert done[ids[1]].finish_reason == "abort" and done[ids[4]].finish_reason == "abort"
    assert done[ids[1]].token_ids == mock_outputs(*work[1], VOCAB)[:len(done[ids[1]].token_ids)]
    assert done[ids[4]].token_ids == []
    done = eng.run_to_completion(done=done)
    for i in (0, 2, 3):
        assert done[ids[i]].token_ids == mock_outputs(*work[i], VOCAB)
    assert eng.stats.finished == {"abort": 2, "length": 3}
    _assert_no_leaks(eng)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_stops_the_engine_with_its_error(monkeypatch, async_scheduling):
    """After a step raises, the engine refuses more work and names the first error rather
    than scheduling on sequences whose tokens will never be read (an offline LLM's next
    generate() spun in schedule() forever)."""
    from nanojax.errors import EngineDeadError
    eng = _engine(async_scheduling=async_scheduling)
    for p, m in _workload(3, 6):
        eng.add_request(p, _greedy(m))
    eng.step()
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("device lost")
    monkeypatch.setattr(eng.runner, "launch", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        eng.run_to_completion()
    with pytest.raises(EngineDeadError, match="RuntimeError: device lost"):
        eng.step()
    with pytest.raises(EngineDeadError, match="device lost"):
        eng.add_request([1, 2, 3], _greedy(4))
    assert len(calls) == 1  # nothing was launched after the failure


def test_page_tables_follow_extended_and_replaced_page_lists():
    """The runner's kept page tables: a row follows its list as it grows, is rewritten in
    full (its stale tail cleared) when the list is replaced (preemption, a prefix match),
    is cleared when released and reused, and the table grows past its first rows."""
    from nanojax.engine.page_tables import PageTables

    class Seq:
        def __init__(self, pages):
            self.pages = pages

    t = PageTables(width=6, capacity=2)
    a, b, c = Seq([3, 4]), Seq([7]), Seq([9, 9, 9])
    rows = t.rows([a, b])
    np.testing.assert_array_equal(t.table[rows], [[3, 4, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]])
    a.pages.extend([5, 6])
    b.pages = [8]  # replaced: same length, other pages
    np.testing.assert_array_equal(t.table[t.rows([b, a])], [[8, 0, 0, 0, 0, 0],
                                                            [3, 4, 5, 6, 0, 0]])
    a.pages = [1]  # a preempted request's new, shorter list
    np.testing.assert_array_equal(t.table[t.rows([a])], [[1, 0, 0, 0, 0, 0]])
    t.release(b)
    rows = t.rows([c, a, Seq([2])])  # b's row reused (cleared), one past the capacity
    assert len(t) == 3 and len(t.table) == 4
    np.testing.assert_array_equal(t.table[rows], [[9, 9, 9, 0, 0, 0], [1, 0, 0, 0, 0, 0],
                                                  [2, 0, 0, 0, 0, 0]])
