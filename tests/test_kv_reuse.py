"""KV reuse: prefix caching on the GPU pages and the host / disk offload tiers.

Every engine test runs multi-round conversations (each turn repeats the history) that
share a system prompt, and checks greedy tokens against an engine that recomputes
everything, that reuse really happened, and that no page leaked."""
import types
from pathlib import Path

import numpy as np
import pytest

from nanojax.bench.multi_round import run_conversations_offline
from nanojax.bench.workload import Conversation, make_conversations
from nanojax.engine.kv_cache import OutOfPages, PageAllocator
from nanojax.engine.kv_offload import DiskTier, HostTier, PageCopier
from nanojax.engine.llm_engine import EngineConfig, LLMEngine
from nanojax.engine.prefix_cache import block_hash
from nanojax.engine.sampling import SamplingParams
from nanojax.models.bundle import ModelBundle

PAGE = 8
# 16 pages of 8 tokens for up to 4 running conversations of up to ~110 tokens: the GPU
# cache must evict, and a running request gets preempted
SMALL = dict(b_dense=32, num_pages=16, page_size=PAGE, max_model_len=128, max_num_seqs=4,
             fixed_shapes=True)


def _conversations(seed=0, n=6, rounds=3):
    rng = np.random.default_rng(seed)
    system = rng.integers(10, 500, size=19).tolist()  # 2 full pages + 3 tokens, shared
    return [Conversation([((system if k == 0 else []) + rng.integers(10, 500, size=int(
        rng.integers(3, 11))).tolist(), int(rng.integers(6, 20))) for k in range(rounds)])
        for _ in range(n)]


def _engine(bundle, **kw):
    return LLMEngine(bundle, EngineConfig(**{**SMALL, **kw}))


def _assert_no_leaks(eng):
    a = eng.allocator
    a.check_consistent()
    assert a.num_used == 0 and a.num_free == a.num_pages
    assert all(c == 0 for c in a.refcount) and a.num_held == 0  # no offload hold left
    assert eng.kv_usage == 0.0


@pytest.fixture(scope="module")
def recompute(tiny_bundle):
    """The engine without reuse, and its tokens for the standard conversations."""
    eng = _engine(tiny_bundle, enable_prefix_caching=False)
    return eng, run_conversations_offline(eng, _conversations())["output_digests"]


def test_prefix_cache_same_tokens_under_pressure_and_preemption(tiny_bundle, recompute):
    eng = _engine(tiny_bundle)
    shared_at_preemption = []
    preempt = eng.scheduler._preempt

    def spy(seq):  # does the victim hold pages another request shares?
        shared_at_preemption.append(any(eng.allocator.refcount[p] > 1 for p in seq.pages))
        preempt(seq)

    eng.scheduler._preempt = spy
    r = run_conversations_offline(eng, _conversations())
    assert r["output_digests"] == recompute[1]
    assert r["prefix_cache"]["hits"] > 0 and r["prompt_tokens_computed"] < r["prompt_tokens"]
    assert eng.allocator.num_evictions > 0            # the cache ran out and evicted
    assert any(shared_at_preemption)                  # a preempted request held shared pages
    _assert_no_leaks(eng)
    assert eng.allocator.num_cached > 0  # cached pages stay, yet count as free


def test_aborts_keep_counts(tiny_bundle, recompute):
    ref_eng = recompute[0]
    rng = np.random.default_rng(4)
    system = rng.integers(10, 500, size=21).tolist()
    prompts = [system + rng.integers(10, 500, size=int(rng.integers(1, 20))).tolist()
               for _ in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    eng = _engine(tiny_bundle)
    ids = [eng.add_request(p, params) for p in prompts]
    for _ in range(3):
        eng.step()
    aborted = {ids[i] for i in (0, 3, 7)}  # running and waiting ones
    assert any(eng.requests[i] in eng.scheduler.running for i in aborted)
    for i in aborted:
        assert eng.abort_request(i)
    done = eng.run_to_completion()
    want_ids = [ref_eng.add_request(p, params) for p in prompts]
    want = ref_eng.run_to_completion()
    for rid, wid in zip(ids, want_ids):
        if rid not in aborted:
            assert done[rid].token_ids == want[wid].token_ids
    assert eng.prefix_cache.stats.hits > 0
    _assert_no_leaks(eng)


def _count_reclaims(eng) -> list:
    """Counts the allocator's reclaims (held pages it needed: a forced flush each)."""
    calls, real = [], eng.allocator.reclaim
    eng.allocator.reclaim = lambda: (calls.append(eng.allocator.num_held), real())
    return calls


def test_host_tier_loads_instead_of_recomputing(tiny_bundle, recompute):
    eng = _engine(tiny_bundle, kv_offload_host_bytes=1 << 20)
    reclaims = _count_reclaims(eng)
    r = run_conversations_offline(eng, _conversations())
    assert r["output_digests"] == recompute[1]
    assert r["offload"]["saved_pages"] > 0 and r["offload"]["loaded_host_pages"] > 0
    assert r["prefix_cache"]["tier_hits"] == r["offload"]["loaded_host_pages"] * PAGE
    assert reclaims and all(reclaims)  # 16 pages: the allocator needed held pages back
    _assert_no_leaks(eng)
    eng.offloader.close()


def test_offload_batches_its_gathers(tiny_bundle, recompute):
    """Saved pages wait for a whole chunk (or MAX_SAVE_WAIT iterations) before one gather
    copies them out: far fewer gathers than iterations that save, the same pages saved
    and the same tokens as a flush forced every iteration (the engine before batching)."""
    runs = {}
    for eager in (False, True):
        # room for every conversation: nothing evicted, so the two runs save the same
        eng = _engine(tiny_bundle, kv_offload_host_bytes=1 << 20, num_pages=64)
        off, saving = eng.offloader, set()
        save, flush = off.save, off.flush

        def spy_save(pages, hashes, off=off, save=save, saving=saving, eng=eng):
            queued = len(off._to_save)
            save(pages, hashes)
            if len(off._to_save) > queued:
                saving.add(eng.stats.steps)
        off.save = spy_save
        if eager:
            off.flush = lambda force=False, flush=flush: flush(force=True)
        r = run_conversations_offline(eng, _conversations())
        assert r["output_digests"] == recompute[1]
        _assert_no_leaks(eng)
        off.close()
        runs[eager] = r["offload"], len(saving)
    (batched, saving), (eager, eager_saving) = runs[False], runs[True]
    assert saving > 20 and eager["gathers"] >= eager_saving  # one gather an iteration
    assert batched["gathers"] <= saving / 4
    assert batched["saved_pages"] == eager["saved_pages"] > 0
    assert batched["saves_dropped"] == batched["save_errors"] == 0


def test_held_pages_through_preemption_and_abort(tiny_bundle, recompute):
    """Pages queued for the tier are held, not used: a tight cache preempts no more than
    without offload, a preempted or aborted request's held pages go back after their
    copy, and the survivors' tokens are the recompute's."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, 500, size=20).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    got = {}
    for offload in (0, 1 << 20):
        eng = _engine(tiny_bundle, kv_offload_host_bytes=offload)
        held_at_preemption, preempt = [], eng.scheduler._preempt

        def spy(seq, eng=eng, preempt=preempt, held=held_at_preemption):
            held.append(sum(p in eng.allocator._holds for p in seq.pages))
            preempt(seq)
        eng.scheduler._preempt = spy
        ids = [eng.add_request(p, params) for p in prompts]
        for _ in range(12):
            eng.step()
        aborted = next(i for i in ids if eng.requests[i] in eng.scheduler.running)
        if offload:
            assert eng.allocator.num_held > 0  # saves wait for a chunk, held meanwhile
        assert eng.abort_request(aborted)
        done = eng.run_to_completion()
        _assert_no_leaks(eng)
        got[offload] = ({i: done[i].token_ids for i in ids if i != aborted},
                        len(held_at_preemption), held_at_preemption)
        if offload:
            assert eng.offloader.stats.saved_pages > 0
            eng.offloader.close()
    (plain, n_plain, _), (offl, n_offl, held) = got[0], got[1 << 20]
    assert offl == plain and n_offl == n_plain > 0
    assert any(held)  # a victim had pages waiting for their copy out
    ref = recompute[0]
    ref_ids = {i: ref.add_request(p, params) for i, p in zip(ids, prompts) if i != aborted}
    ref_done = ref.run_to_completion()
    assert all(offl[i] == ref_done[r].token_ids for i, r in ref_ids.items())


def test_pages_reach_the_host_tier_as_they_fill(tiny_bundle):
    """A running request's full pages are copied out before it finishes (spread over its
    life, not a burst at the end), and finishing offers nothing new but its last pages."""
    eng = _engine(tiny_bundle, kv_offload_host_bytes=1 << 20)
    prompt = list(range(10, 10 + 3 * PAGE + 2))
    eng.add_request(prompt, SamplingParams(max_tokens=3 * PAGE, ignore_eos=True))
    seq = next(iter(eng.requests.values()))
    for _ in range(4):  # the prompt's 3 full pages, and a few decode steps
        eng.step()
    eng.offloader.drain()
    assert not seq.is_finished and seq.num_cached_pages >= 3
    host = eng.offloader.host
    assert all(host.contains(h) for h in seq.block_hashes[:seq.num_cached_pages])
    saved_while_running = eng.offloader.stats.saved_pages
    while eng.has_unfinished():
        eng.step()
    eng.offloader.drain()
    full = (len(prompt) + 3 * PAGE - 1) // PAGE  # the last token's KV is never written
    assert eng.offloader.stats.saved_pages == full > saved_while_running
    _assert_no_leaks(eng)
    eng.offloader.close()


def test_a_request_waits_for_its_staged_load_and_an_abort_drops_it(tiny_bundle, recompute):
    """Tier pages are staged on the device off the engine thread: the request stays out of
    the batch and its loaded pages out of the prefix cache until the staging is done, then
    gives the recompute's tokens; aborted (or preempted) while loading, it leaks nothing."""
    import concurrent.futures
    import threading
    eng = _engine(tiny_bundle, kv_offload_host_bytes=1 << 20)
    rng = np.random.default_rng(5)
    prompt = rng.integers(10, 500, size=3 * PAGE + 1).tolist()
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request(prompt, greedy)
    eng.run_to_completion()
    for _ in range(2):  # others fill the 16 pages: the prompt's pages leave the GPU
        eng.add_request(rng.integers(10, 500, size=12 * PAGE).tolist(), greedy)
        eng.run_to_completion()
    eng.offloader.drain()
    gates, threads, real = [], [], eng.offloader.stage

    def held(pages, entries):  # the staging finishes only when its gate opens
        fut, gate = concurrent.futures.Future(), threading.Event()
        gates.append(gate)

        def run():
            gate.wait()
            if fut.set_running_or_notify_cancel():  # not cancelled by the scheduler
                fut.set_result(real(pages, entries).result())
        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
        return fut
    eng.offloader.stage = held
    rid = eng.add_request(prompt + [7, 8], greedy)
    seq = eng.requests[rid]
    for _ in range(3):
        eng.step()
    assert len(gates) == 1 and seq.loading is not None and seq.output_ids == []
    assert all(eng.allocator.lookup(h) is None for h in seq.block_hashes[:3])
    gates[0].set()
    done = eng.run_to_completion()
    ref_eng = recompute[0]
    ref_id = ref_eng.add_request(prompt + [7, 8], greedy)
    assert done[rid].token_ids == ref_eng.run_to_completion()[ref_id].token_ids
    assert eng.offloader.stats.loaded_host_pages >= 3
    # aborted while its pages are on the way: nothing leaks, nothing gets cached
    for _ in range(2):
        eng.add_request(rng.integers(10, 500, size=12 * PAGE).tolist(), greedy)
        eng.run_to_completion()
    rid = eng.add_request(prompt + [9], greedy)
    eng.step()
    aborted = eng.requests[rid]
    assert aborted.loading is not None
    eng.abort_request(rid)
    eng.run_to_completion()
    assert aborted.loading is None  # dropped (its Future cancelled)
    gates[-1].set()
    threads[-1].join()
    _assert_no_leaks(eng)
    eng.offloader.close()


def test_disk_tier_survives_restart_and_rejects_bad_entries(tiny_bundle, recompute, tmp_path):
    convs = _conversations()
    first = _engine(tiny_bundle, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    assert run_conversations_offline(first, convs)["output_digests"] == recompute[1]
    first.offloader.close()
    disk_dir = first.offloader.disk.dir
    files = sorted(disk_dir.glob("*.kv"))
    assert len(files) > 4
    # damage two entries: the system prompt's first page cut short (every conversation
    # asks for it first), another page with a flipped payload byte
    system_page = block_hash(first.prefix_cache.root, convs[0].turns[0][0][:PAGE])
    truncated = disk_dir / f"{system_page.hex()}.kv"
    flipped = next(f for f in files if f != truncated)
    truncated.write_bytes(truncated.read_bytes()[:-7])
    blob = bytearray(flipped.read_bytes())
    blob[-3] ^= 0xFF
    flipped.write_bytes(bytes(blob))
    # a new engine, the same model and directory: the same conversations from disk
    again = _engine(tiny_bundle, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    assert len(again.offloader.disk) == len(files)
    r = run_conversations_offline(again, convs)
    assert r["output_digests"] == recompute[1]      # never served a bad entry
    assert r["offload"]["loaded_disk_pages"] > 0
    disk = again.offloader.disk
    assert r["offload"]["disk_corrupt"] >= 1  # the system page: caught, recomputed
    if disk.num_corrupt < 2:  # the other was not asked for: reading it fails the check
        assert disk.get(bytes.fromhex(flipped.stem)) is None and not flipped.exists()
    assert disk.num_corrupt == 2
    again.offloader.drain()  # the recomputed system page was saved again, intact
    assert disk.get(system_page) is not None
    _assert_no_leaks(again)
    again.offloader.close()
    # with a host tier, an arriving request's disk pages are read ahead into host memory
    ahead = _engine(tiny_bundle, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20,
                    kv_offload_host_bytes=1 << 20)
    prompt, params = convs[1].turns[0][0], SamplingParams(max_tokens=5, temperature=0)
    rid = ahead.add_request(prompt, params)
    ahead.offloader.drain()
    assert ahead.offloader.stats.prefetched_disk_pages == (len(prompt) - 1) // PAGE
    got = ahead.run_to_completion()[rid].token_ids
    assert ahead.offloader.stats.loaded_host_pages == (len(prompt) - 1) // PAGE
    ref = recompute[0]
    ref_id = ref.add_request(prompt, params)
    assert got == ref.run_to_completion()[ref_id].token_ids
    ahead.offloader.close()
    # another model's engine on the same directory sees none of it
    other = ModelBundle(tiny_bundle.config, _perturbed(tiny_bundle.params), None)
    stranger = _engine(other, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    assert stranger.offloader.disk.dir != disk.dir and len(stranger.offloader.disk) == 0
    stranger.offloader.close()


def _perturbed(params):
    import jax
    leaves, tree = jax.tree_util.tree_flatten(params)
    leaves[0] = leaves[0] * 1.5
    return jax.tree_util.tree_unflatten(tree, leaves)


# ---- units --------------------------------------------------------------------------------
def test_allocator_refcounts_and_lru_eviction():
    a = PageAllocator(4)
    p = a.allocate(3)
    assert [a.register(x, bytes([i])) for i, x in enumerate(p)] == [True] * 3
    assert not a.register(p[0], b"\x09") and not a.register(a.allocate(1)[0], b"\x00")
    a.ref(p[0])                      # shared by a second sequence
    a.free(p[::-1])                  # the first sequence goes, tail first
    assert a.refcount[p[0]] == 1 and a.num_used == 2 and a.num_cached == 3
    new = a.allocate(1)              # the plain page list is empty: evict the LRU cached page
    assert new == [p[2]] and a.lookup(bytes([2])) is None and a.num_evictions == 1
    assert a.lookup(bytes([1])) == p[1]
    a.ref(p[1])                      # a hit takes a cached-free page back
    with pytest.raises(OutOfPages):
        a.allocate(1)
    with pytest.raises(RuntimeError):
        a.ref(new[0])                # not cached
    a.free([p[0], p[1], new[0], 3])
    with pytest.raises(RuntimeError):
        a.free([p[0]])
    a.check_consistent()
    assert a.num_free == 4


def test_allocator_holds_count_as_free_until_handed_out():
    """A held page stays off the free lists only while a sequence uses it; allocate()
    reclaims (releases every hold) before it hands out a held page, never earlier."""
    a = PageAllocator(4)
    p = a.allocate(2)  # pages 0, 1
    assert a.register(p[0], b"x")
    with pytest.raises(RuntimeError):
        a.hold(3)  # not in use: nothing to hold
    a.hold(p[0])
    a.free([p[1], p[0]])
    assert a.num_free == 4 and a.num_used == 0 and a.num_held == 1 and a.is_free(p[0])
    assert a.refcount[p[0]] == 1
    with pytest.raises(RuntimeError):
        a.free([p[0]])  # only the hold keeps it: no sequence may drop it again
    a.ref(p[0])  # a prefix hit takes a held cached page
    assert a.num_free == 3 and not a.is_free(p[0])
    a.free([p[0]])
    a.check_consistent()
    calls = []
    a.reclaim = lambda: (calls.append(1), a.release([p[0]]))
    assert sorted(a.allocate(3)) == [1, 2, 3] and calls == []  # plain pages first
    assert a.allocate(1) == [p[0]] and calls == [1]  # the held page: reclaimed first
    assert a.num_evictions == 1 and a.num_held == 0 and a.lookup(b"x") is None
    with pytest.raises(RuntimeError):
        a.release([p[0]])  # not held
    a.hold(2)
    a.hold(2)  # two holds, released one at a time
    a.release([2])
    a.free([0, 1, 2, 3])
    assert a.num_free == 4 and a.num_held == 1
    a.release([2])
    a.check_consistent()
    assert a.num_held == 0 and all(c == 0 for c in a.refcount)


def test_offloader_flushes_whole_chunks_and_never_leaks_holds(monkeypatch):
    """flush() gathers whole chunks; a part chunk waits MAX_SAVE_WAIT flushes (or a
    forced flush); a dropped save and a gather that raises release their holds too."""
    import jax.numpy as jnp

    from nanojax.engine import kv_offload
    monkeypatch.setattr(kv_offload, "MAX_COPY_PAGES", 4)  # chunks of 4 pages
    kv = [jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)]
    runner = types.SimpleNamespace(kv=kv, with_kv=lambda fn: fn(kv))
    a = PageAllocator(16)
    off = kv_offload.KVOffloader(runner, 16, 0, b"fp", host_bytes=1 << 20, allocator=a)
    pages = a.allocate(10)
    hashes = [bytes([i]) * 4 for i in range(10)]
    off.save(pages[:6], hashes[:6])
    off.flush()  # one whole chunk goes; two pages wait, held
    assert off.stats.gathers == 1 and a.num_held == 2
    for _ in range(kv_offload.MAX_SAVE_WAIT - 2):
        off.flush()
    assert off.stats.gathers == 1 and a.num_held == 2
    off.flush()  # the oldest has waited MAX_SAVE_WAIT flushes
    assert off.stats.gathers == 2 and a.num_held == 0
    off.save(pages[6:8], hashes[6:8])
    off.save(pages[:2], hashes[:2])  # saved (or on the way) already: not queued again
    assert a.num_held == 2
    monkeypatch.setattr(kv_offload, "MAX_PENDING_BYTES", 0)  # every gather dropped
    off.flush(force=True)
    assert off.stats.saves_dropped == 2 and a.num_held == 0
    monkeypatch.setattr(kv_offload, "MAX_PENDING_BYTES", 1 << 30)

    def broken(pages):
        raise RuntimeError("no gather")
    monkeypatch.setattr(off.copier, "start_gather", broken)
    off.save(pages[6:10], hashes[6:10])  # dropped ones may be queued again
    off.flush()
    assert off.stats.save_errors == 1 and a.num_held == 0
    monkeypatch.undo()
    a.free(pages)
    a.check_consistent()
    assert a.num_free == 16 and all(c == 0 for c in a.refcount)
    off.drain()
    assert off.stats.saved_pages == 6 and off._pending == 0  # the failed gather's bytes too
    assert len(off.fetch(hashes[:6])) == 6 and not off.contains(hashes[6])
    off.close()


def test_hash_chain_names_prefix_and_model():
    a, b = block_hash(b"m1", [1, 2, 3]), block_hash(b"m1", [1, 2, 3])
    assert a == b and block_hash(b"m2", [1, 2, 3]) != a
    assert block_hash(a, [4]) != block_hash(block_hash(b"m1", [1, 2, 4]), [4])


def test_host_tier_byte_limit_is_lru():
    t = HostTier(3 * 64)
    page = np.zeros(64, np.uint8)
    for i in range(3):
        t.put(bytes([i]), page)
    t.get(b"\x00")                   # recently used: survives
    t.put(b"\x03", page)
    assert t.contains(b"\x00") and not t.contains(b"\x01") and t.bytes == 3 * 64


def test_host_tier_charges_a_split_block_once():
    """A split's pages are views of one block: charged once while any page is held,
    released with the last, and the blocks held never exceed max_bytes."""
    blocks = {name: np.zeros((4, 64), np.uint8) for name in "ab"}
    owners = {}
    t = HostTier(5 * 64)

    def put(h, e):
        t.put(h, e)
        if e.base is None:
            owners[h] = e
        held = {n for n in blocks for i in range(4) if t.contains(f"{n}{i}".encode())}
        real = sum(blocks[n].nbytes for n in held) + sum(
            e.nbytes for h, e in owners.items() if t.contains(h))
        assert t.bytes == real <= t.max_bytes  # charged == the memory the pages keep alive

    for i, e in enumerate(blocks["a"]):  # rows: views, as PageCopier.split returns them
        put(f"a{i}".encode(), e)
    assert len(t) == 4 and t.bytes == 4 * 64  # one block, charged once
    put(b"own", np.zeros(64, np.uint8))  # owns its memory: charged for itself
    t.get(b"a2"), t.get(b"a3")  # LRU order: a0 a1 own a2 a3
    put(b"n1", np.zeros(64, np.uint8))  # evicts a0, a1, then `own` frees the room
    assert [t.contains(h) for h in (b"a0", b"a1", b"own", b"a2", b"a3")] == [
        False, False, False, True, True]
    assert t.bytes == 5 * 64 and t.num_evictions == 3  # a's block: still whole, charged
    put(b"n2", np.zeros(64, np.uint8))  # a2, a3 go: the block goes with its last page
    assert len(t) == 2 and t.bytes == 2 * 64 and t.num_evictions == 5
    for i, e in enumerate(blocks["b"]):
        put(f"b{i}".encode(), e)  # b0 evicts n1 for the block; b1..b3 cost nothing
    assert len(t) == 5 and t.bytes == 5 * 64 and t.num_evictions == 6
    put(b"a1", blocks["a"][1])  # a page again: its whole block is charged again
    assert not t.contains(b"n2") and not t.contains(b"b0") and t.contains(b"a1")
    big = np.zeros((8, 64), np.uint8)  # a backing beyond the limit: not stored
    put(b"big", big[0])
    assert not t.contains(b"big")
    many = HostTier(5 * 64)  # a chunk at once (the offload worker's way): the same charge
    many.put_many([b"c0", b"own", b"c1"], [blocks["a"][0], np.zeros(64, np.uint8),
                                           blocks["a"][1]])
    assert len(many) == 3 and many.bytes == blocks["a"].nbytes + 64


def test_disk_tier_limit_and_restart_order(tmp_path):
    page = np.arange(70, dtype=np.uint8)
    d = DiskTier(tmp_path, b"fp", 1 << 20)
    d.put(b"\x01", page)
    size = d.bytes
    small = DiskTier(tmp_path, b"fp", 2 * size + 1)   # restart with room for two
    assert small.contains(b"\x01")
    small.put(b"\x02", page)
    small.put(b"\x03", page)                           # drops the oldest
    assert not small.contains(b"\x01") and not (small.dir / "01.kv").exists()
    got = small.get(b"\x02")
    assert got.dtype == np.uint8 and np.array_equal(got, page)
    assert DiskTier(tmp_path, b"other", 1 << 20).get(b"\x02") is None
    other_layout = DiskTier(tmp_path, b"fp", 1 << 20, page_bytes=64)  # pages are 70 bytes
    assert other_layout.get(b"\x02") is None and other_layout.num_corrupt == 1


def test_page_copier_is_generic_over_the_cache_tree(monkeypatch):
    """Per-layer (k, v, scale) with the page axis first, and a leaf without pages."""
    import jax
    import jax.numpy as jnp

    from nanojax.engine import kv_offload
    monkeypatch.setattr(kv_offload, "MAX_COPY_PAGES", 8)  # page buckets 4 and 8
    rng = np.random.default_rng(0)
    kv = [(jnp.asarray(rng.normal(size=(6, 2, 4, 3)), jnp.float32),
           jnp.asarray(rng.normal(size=(6, 2, 4, 3)), jnp.bfloat16),
           jnp.asarray(rng.normal(size=(6, 2)), jnp.float32), jnp.ones((5,)))
          for _ in range(2)]
    old = [[np.asarray(x) for x in layer] for layer in kv]  # the scatter donates kv
    runner = types.SimpleNamespace(kv=kv)
    runner.with_kv = lambda fn: fn(runner.kv)

    def update(fn):
        runner.kv = fn(runner.kv)
    runner.update_kv = update
    cp = PageCopier(runner, 6, 0)
    assert cp.warmup() == 4  # compiles the copies, writes nothing
    np.testing.assert_array_equal(np.asarray(runner.kv[1][0]), old[1][0])
    assert cp.paged == [True, True, True, False] * 2
    gathered = cp.start_gather([4, 1])
    entries = cp.split(gathered, 2)
    page = (2 * 4 * 3) * (4 + 2) + 2 * 4  # f32 k, bf16 v, f32 scales: one byte row a page
    assert cp.page_bytes == 2 * page and [e.shape for e in entries] == [(2 * page,)] * 2
    assert entries[0][page + 96:page + 144].tobytes() == old[1][1][4].tobytes()
    # one host block for the chunk, aliasing neither the gather nor the cache
    assert entries[0].base is entries[1].base and entries[0].base.flags.owndata
    assert not any(np.shares_memory(e, x) for e in entries
                   for x in [np.asarray(gathered)] + [np.asarray(y) for y in
                                                      jax.tree_util.tree_leaves(runner.kv)])
    saved = [e.copy() for e in entries]
    cp.scatter(cp.stage([4, 1], entries[::-1]))  # overwrites the split's own pages
    assert np.asarray(runner.kv[1][1][4]).tobytes() == old[1][1][1].tobytes()
    assert all(np.array_equal(e, s) for e, s in zip(entries, saved))
    cp.scatter(cp.stage([4, 1], entries))  # back as they were
    entries = cp.split(cp.start_gather([4, 1]), 2)
    cp.scatter(cp.stage([0, 5], entries))  # staged on the device, then copied in
    new = runner.kv
    for layer in range(2):
        for j in range(3):
            got = np.asarray(new[layer][j])
            np.testing.assert_array_equal(got[0], old[layer][j][4])
            np.testing.assert_array_equal(got[5], old[layer][j][1])
            np.testing.assert_array_equal(got[2], old[layer][j][2])


def test_offloader_drops_saves_past_the_pending_bound(monkeypatch):
    """Gathers not yet copied to the host hold device memory: past the bound a save is
    dropped (counted), never waited for; under it every page lands in the host tier."""
    import jax.numpy as jnp

    from nanojax.engine import kv_offload
    kv = [jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)]
    runner = types.SimpleNamespace(kv=kv, with_kv=lambda fn: fn(kv))
    off = kv_offload.KVOffloader(runner, 8, 0, b"fp", host_bytes=1 << 20)
    page = off.copier.page_bytes
    monkeypatch.setattr(kv_offload, "MAX_PENDING_BYTES", 4 * page - 1)  # < one gather
    off.save([1, 2], [b"a", b"b"])
    off.flush()
    off.drain()
    assert off.stats.saves_dropped == 2 and off.stats.saved_pages == 0
    monkeypatch.setattr(kv_offload, "MAX_PENDING_BYTES", 4 * page)
    off.save([1, 2], [b"a", b"b"])  # dropped hashes may be queued again
    off.flush()
    off.drain()
    assert off.stats.saved_pages == 2 and off._pending == 0
    got = off.fetch([b"b", b"a"])
    assert got[0].tobytes() == np.asarray(kv[0][2]).tobytes()
    off.close()


def test_multi_round_bench_compares_reuse_modes(tmp_path):
    """`nanojax bench --multi-round N --reuse-modes ...`: each mode on the same turns in
    one process; reuse computes fewer prompt tokens and changes no greedy token."""
    import json

    from nanojax.cli import main
    out = tmp_path / "r.json"
    assert main(["bench", "--model", "random:tiny", "--quiet", "--b-dense", "32",
                 "--fixed-shapes", "--max-model-len", "128", "--max-num-seqs", "4",
                 "--num-pages", "16", "--page-size", "8", "--input-len", "24",
                 "--output-len", "8", "--num-prompts", "4", "--multi-round", "3",
                 "--reuse-modes", "recompute,prefix,offload", "--kv-offload-host-bytes", "1M",
                 # (a folder that does not exist yet: the bench makes it)
                 "--timeline", str(tmp_path / "new" / "tl.json"), "--timeline-at", "2",
                 "--timeline-iterations", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    for mode, r in res.items():  # the profiled iterations change no token (checked below)
        assert r["timeline"]["first_iteration"] == 2
        assert Path(r["timeline"]["raw_trace"]).exists()
    computed = {m: r["prompt_tokens_computed"] for m, r in res.items()}
    assert computed["offload"] < computed["prefix"] < computed["recompute"]
    assert res["prefix"]["same_outputs_as_recompute"] == 1.0
    assert res["offload"]["same_outputs_as_recompute"] == 1.0
    assert res["offload"]["offload"]["loaded_host_pages"] > 0


def test_conversations_fit_max_model_len():
    convs = make_conversations(20, 4, 500, trace="sharegpt", max_model_len=1024, seed=1)
    assert all(c.turns for c in convs) and max(len(c.turns) for c in convs) > 1
    for c in convs:
        assert sum(len(u) + o for u, o in c.turns) <= 1024


def test_metrics_report_prefix_cache_and_usage():
    from prometheus_client.parser import text_string_to_metric_families

    from nanojax.engine.kv_offload import OffloadStats
    from nanojax.engine.prefix_cache import PrefixCacheStats
    from nanojax.server.metrics import ServerMetrics
    eng = types.SimpleNamespace(num_running=0, kv_usage=0.25,
                                prefix_cache=types.SimpleNamespace(
                                    stats=PrefixCacheStats(queries=100, hits=48, tier_hits=16)),
                                offloader=types.SimpleNamespace(stats=OffloadStats(
                                    saved_pages=9, saves_dropped=2, disk_writes_dropped=1)))
    m = ServerMetrics(types.SimpleNamespace(engine=eng, num_pending=0), "m")
    got = {s.name: s.value for f in text_string_to_metric_families(m.render().decode())
           for s in f.samples}
    assert got["nanojax:prefix_cache_queries_total"] == 100
    assert got["nanojax:prefix_cache_hits_total"] == 48
    assert got["nanojax:kv_offload_hits_total"] == 16
    assert got["nanojax:kv_cache_usage_perc"] == 0.25
    assert got["nanojax:kv_offload_saved_pages_total"] == 9
    assert got["nanojax:kv_offload_dropped_pages_total"] == 3


def test_gpu_attention_kernels_prefill_after_cached_pages(tiny_bundle):
    """The GPU path (chunked-prefill, decode and fused append kernels, interpret mode):
    prefills that start after shared pages give the tokens of the pure-JAX forward
    without reuse."""
    from nanojax.engine.forward import UnrolledForward
    from nanojax.config import KernelConfig
    from nanojax.layers.attention import paged_attention, pallas_backend
    cfg = tiny_bundle.config
    rng = np.random.default_rng(5)
    first = [rng.integers(1, cfg.vocab_size, size=n).tolist() for n in (23, 13)]
    second = [first[0] + rng.integers(1, cfg.vocab_size, size=6).tolist(), first[1][:9],
              first[0][:17] + [3]]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs, stats = [], None
    for attention, reuse in ((paged_attention, {"enable_prefix_caching": False}),
                             (pallas_backend(KernelConfig(
                                 prefill_kernel=True, prefill_block_q=4, fused_append=True,
                                 interpret=True)), {})):
        eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=40, page_size=4,
                                                  max_model_len=64, **reuse),
                        forward=UnrolledForward(cfg, attention))
        got = []
        for wave in (first, second):
            ids = [eng.add_request(p, params) for p in wave]
            done = eng.run_to_completion()
            got += [done[i].token_ids for i in ids]
        outs.append(got)
        stats = eng.prefix_cache and eng.prefix_cache.stats
    assert outs[0] == outs[1]
    assert stats.hits > 0
