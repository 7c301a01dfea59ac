"""The scheduler's array-backed state (issue 43: the running requests' numbers kept as
columns, updated where they change) against a recomputation from the Sequences, through
random joins, finishes, aborts, preemptions and prefix-cache hits; the vectorized predicted
admission against its definition; the fit of steps to the engine's compiled shapes."""
import numpy as np
import pytest

from nanojax.bench.schedule_sim import launch_summary, read_tokens, simulate
from nanojax.engine import scheduler
from nanojax.engine.kv_cache import PageAllocator
from nanojax.engine.runner import bucket
from nanojax.engine.prefix_cache import PrefixCache
from nanojax.engine.sampling import SamplingParams
from nanojax.engine.scheduler import (RowView, Scheduler, _fitting_prefix, held_pages,
                                      predicted_peak)
from nanojax.engine.sequence import Sequence


def _assert_rows_match(sched: Scheduler) -> None:
    r = sched._rows.view()
    running = sched.running
    assert len(r.key) == len(running) == len(sched._key_of)
    assert list(r.key) == [sched._key_of[s] for s in running]
    assert np.all(np.diff(r.key) > 0)  # ascending: found by binary search
    want = {"prompt": [len(s.prompt_ids) for s in running],
            "total": [s.num_total for s in running],
            "computed": [s.num_computed for s in running],
            "pages": [len(s.pages) for s in running],
            "cached": [s.num_cached_pages for s in running],
            "loading": [s.loading is not None for s in running],
            "max_tokens": [s.params.max_tokens for s in running],
            "can_stop": [s.can_stop for s in running]}
    assert set(want) | {"key"} == set(RowView._fields)
    for name, values in want.items():
        assert getattr(r, name).tolist() == [int(v) for v in values], name


def _retire(sched: Scheduler, batch, rng) -> int:
    """The engine's reading of a batch: some requests stop early (EOS), the rest at
    max_tokens."""
    return read_tokens(sched, batch, token=lambda seq: int(rng.integers(0, 8)),
                       stop=lambda seq: seq.can_stop and rng.random() < 0.02)


@pytest.mark.parametrize("admission,prefix,pages,shapes,spread", [
    ("greedy", False, 60, (), 0),      # small caches: preemptions (tens)
    ("predicted", False, 90, (), 0),
    ("greedy", True, 60, (), 0),       # shared prefixes: cached pages, evictions, preemptions
    ("predicted", True, 260, (), 0),
    ("predicted", True, 260, (8, 16, 32, 48), 0),  # prefill tails wait for a smaller shape
    ("greedy", True, 60, (8, 16, 32, 48), 2),      # prompts spread over steps
    ("predicted", False, 70, (8, 16, 32, 48), 2),
])
def test_columns_match_the_sequences_through_random_traffic(admission, prefix, pages,
                                                           shapes, spread, monkeypatch):
    room = scheduler._Room.__init__

    def checked_room(self, sched):  # mid-iteration too: admission reads the columns
        _assert_rows_match(sched)
        room(self, sched)
    monkeypatch.setattr(scheduler._Room, "__init__", checked_room)
    rng = np.random.default_rng(7)
    ps = 4
    alloc = PageAllocator(pages)
    sched = Scheduler(alloc, ps, b_dense=48, max_num_seqs=24, max_model_len=96,
                      chunk_cuts=(16, 32), admission=admission, max_prefill_seqs=4,
                      prefix_cache=PrefixCache(alloc, ps, b"root") if prefix else None)
    sched.step_shapes, sched.prefill_spread = shapes, spread
    fitted = 0
    stems = [rng.integers(0, 8, 40).tolist() for _ in range(3)]
    n, left, in_flight, aborted = 0, 0, None, 0
    for it in range(600):
        if it < 400 and rng.random() < 0.5:  # arrivals
            for _ in range(int(rng.integers(1, 4))):
                prompt = (stems[n % 3][:int(rng.integers(4, 40))]
                          + rng.integers(0, 8, int(rng.integers(1, 12))).tolist())
                sched.add(Sequence(f"r{n}", prompt, SamplingParams(
                    max_tokens=int(rng.integers(1, 40)), ignore_eos=bool(n % 2))))
                n, left = n + 1, left + 1
        batch = sched.schedule(in_flight)
        _assert_rows_match(sched)
        assert batch.num_tokens == sum(e.num_tokens for e in batch.entries)
        assert all(e.num_tokens > 0 for e in batch.entries)
        fitted += batch.num_tokens in shapes
        if in_flight is not None:  # a decode's input on the device: its row there
            rows = {id(e.seq): row for row, e in enumerate(in_flight.entries)}
            for e in batch.entries[:batch.num_decodes]:
                assert e.prev_row == rows.get(id(e.seq), -1)
        if in_flight is not None:
            left -= _retire(sched, in_flight, rng)
        if rng.random() < 0.1 and batch:  # now and then a step read at once (no async)
            left -= _retire(sched, batch, rng)
            batch = None
        if rng.random() < 0.05 and left:  # an abort, running or waiting
            seq = rng.choice(np.array(sched.running + list(sched.waiting), dtype=object))
            seq.finish("abort")
            sched.remove(seq)
            left, aborted = left - 1, aborted + 1
        _assert_rows_match(sched)
        in_flight = batch or None
    while left:  # drain
        batch = sched.schedule(in_flight)
        _assert_rows_match(sched)
        if in_flight is not None:
            left -= _retire(sched, in_flight, rng)
        assert batch or in_flight is not None, "stalled"
        in_flight = batch or None
    assert not sched.running and not sched._key_of and sched._rows.n == 0
    assert alloc.num_free == pages
    if pages < 100:
        assert sched.num_preemptions > 10  # the small caches did preempt
    if prefix:
        assert sched.prefix_cache is not None and sched.prefix_cache.stats.hits > 0
    assert aborted > 0
    if shapes:
        assert fitted > 50


def test_a_prefill_tail_waits_where_the_step_then_runs_a_smaller_shape():
    """12 decodes and a 30-token prompt: 42 tokens would run at 64 (22 padding); 10 of
    the prompt wait a step, which runs at 32, the next at 32 too (12 decodes + 10). Not
    where as many would wait as the larger shape pads, nor more than go now."""
    def first_steps(prompt_len: int, decodes: int = 12):
        """The decodes' prompts (2 tokens each: no smaller shape fits), then, with that
        step in flight (as the engine's), the decodes and the prompt."""
        sched = Scheduler(PageAllocator(256), 4, 64, 32, 128)
        sched.step_shapes = (8, 16, 32, 64)
        for i in range(decodes):
            sched.add(Sequence(f"d{i}", [1, 2], SamplingParams(max_tokens=50,
                                                               ignore_eos=True)))
        first = sched.schedule()
        assert first.num_tokens == 2 * decodes
        sched.add(Sequence("p", list(range(prompt_len)), SamplingParams(max_tokens=5)))
        return sched, first, sched.schedule(first)
    sched, first, batch = first_steps(30)
    assert batch.num_decodes == 12 and batch.num_tokens == 32
    tail = batch.entries[-1]
    assert (tail.seq.request_id, tail.start, tail.num_tokens, tail.samples) == ("p", 0, 20,
                                                                               False)
    _retire(sched, first, np.random.default_rng(0))
    after = sched.schedule(batch)
    assert after.num_decodes == 12 and after.num_tokens == 22
    tail = after.entries[-1]
    assert (tail.seq.request_id, tail.start, tail.num_tokens, tail.samples) == ("p", 20, 10,
                                                                               True)
    # 12 + 44 = 56: 24 would wait, 8 padding at 64: it runs whole
    assert first_steps(44)[2].num_tokens == 56
    # 12 + 22 = 34: 2 wait (30 padding at 64), 20 go
    assert first_steps(22)[2].num_tokens == 32
    # 28 + 8 = 36: 4 wait, 4 go: allowed
    assert first_steps(8, decodes=28)[2].num_tokens == 32
    # 28 + 10 = 38: 6 would wait, 4 go: it runs whole, at 64
    assert first_steps(10, decodes=28)[2].num_tokens == 38


def _shapes(b_dense: int, step: int) -> tuple[int, ...]:
    """The engine's token buckets: 16, 32, 64, ... below step, then multiples of it."""
    out = [bucket(1, 16, b_dense, step)]
    while out[-1] < b_dense:
        out.append(bucket(out[-1] + 1, 16, b_dense, step))
    return tuple(out)


def _launched(lengths, b_dense, step, pages, spread):
    shapes = _shapes(b_dense, step)
    (prompt, out), page = lengths[0], 16
    records, sched = simulate(lengths, b_dense, num_pages=pages, page_size=page,
                              max_num_seqs=min(b_dense, pages * page // ((prompt + out) // 2)),
                              max_model_len=prompt + out, admission="predicted",
                              max_prefill_seqs=64, step_shapes=shapes, prefill_spread=spread)
    return launch_summary(records, sched, shapes)


def test_spread_prompts_fill_the_shapes_where_the_cache_bounds_the_batch():
    """512/512 in 1,200 pages of 16 (~24 requests at once, B_dense 512): a new prompt taken
    whole leaves the steps after it ~24 decodes padded to 64; spread over 8 steps, the
    same requests launch under 92% of the tokens, in at most 3% more iterations."""
    whole = _launched([(512, 512)] * 80, 512, 64, 1200, 0)
    spread = _launched([(512, 512)] * 80, 512, 64, 1200, 8)
    assert spread["real_tokens"] == whole["real_tokens"]
    assert spread["launched_tokens"] < 0.92 * whole["launched_tokens"]
    assert spread["iterations"] <= 1.03 * whole["iterations"]


def test_spreading_waits_where_the_steps_tokens_hold_the_queue(monkeypatch):
    """125/125 with room for ~130 at once at B_dense 256: the queue waits for the step's
    tokens, not the cache, so nothing is spread and the run takes as many iterations.
    Spreading there anyway (the head counted as kept out) holds admission back with the
    prefill, and the batch settles at half: twice the iterations."""
    lengths = [(125, 125)] * 375
    whole = _launched(lengths, 256, 32, 1676, 0)
    assert _launched(lengths, 256, 32, 1676, 8)["iterations"] <= 1.01 * whole["iterations"]
    admit = Scheduler._admit

    def always_held(self, *args):
        out = admit(self, *args)
        self._queue_held = True
        return out
    monkeypatch.setattr(Scheduler, "_admit", always_held)
    assert _launched(lengths, 256, 32, 1676, 8)["iterations"] > 1.5 * whole["iterations"]


def test_a_lone_prompt_is_not_spread():
    """Nothing waits: 4 decodes run alone (the batch's fill far under 0.9), then one
    2,048-token prompt arrives; with the queue empty it goes in at once (two steps, as
    without spreading), not 1/8 of it a step."""
    def steps_to_first_token(spread: int) -> int:
        sched = Scheduler(PageAllocator(4096), 16, 2048, 64, 4096, admission="predicted")
        sched.step_shapes, sched.prefill_spread = _shapes(2048, 256), spread
        for i in range(4):
            sched.add(Sequence(f"d{i}", [1] * 8, SamplingParams(max_tokens=500,
                                                                ignore_eos=True)))
        in_flight = None
        for _ in range(30):  # the decodes alone, long enough for the fill to settle
            batch = sched.schedule(in_flight)
            if in_flight is not None:
                read_tokens(sched, in_flight)
            in_flight = batch
        assert sched._fill < 0.1
        prompt = Sequence("p", [1] * 2048, SamplingParams(max_tokens=5))
        sched.add(prompt)
        for step in range(1, 40):
            batch = sched.schedule(in_flight)
            read_tokens(sched, in_flight)
            in_flight = batch
            if any(e.seq is prompt and e.samples for e in batch.entries):
                return step
        raise AssertionError("the prompt never finished its prefill")
    assert steps_to_first_token(8) == steps_to_first_token(0) <= 2


def test_schedule_takes_the_batch_in_flight_or_its_rows():
    """The engine passes the step in flight; a dict of its rows gives the same batch."""
    def run(as_dict: bool):
        sched = Scheduler(PageAllocator(64), 4, 32, 8, 64)
        for i in range(6):
            sched.add(Sequence(f"r{i}", [1] * (3 + i), SamplingParams(max_tokens=5)))
        out, prev = [], None
        for _ in range(8):
            arg = ({id(e.seq): r for r, e in enumerate(prev.entries)}
                   if as_dict and prev else prev)
            batch = sched.schedule(arg)
            out.append([(e.seq.request_id, e.start, e.num_tokens, e.samples, e.prev_row)
                        for e in batch.entries])
            if prev is not None:
                _retire(sched, prev, np.random.default_rng(0))
            prev = batch or None
        return out
    batches = run(False)
    assert batches == run(True)
    assert any(e[4] >= 0 for b in batches for e in b)  # some inputs came from the device


def test_held_pages_and_fitting_prefix_follow_their_definitions():
    rng = np.random.default_rng(3)
    for _ in range(300):
        ps = int(rng.integers(1, 17))
        n, k = int(rng.integers(0, 30)), int(rng.integers(0, 12))
        now, left = rng.integers(0, 90, n), rng.integers(1, 60, n)
        hnow, hleft = rng.integers(0, 90, k), rng.integers(1, 60, k)
        times = np.unique(rng.integers(0, 70, 8))
        brute = [sum(-(-(now[i] + t) // ps) for i in range(n) if left[i] >= t) for t in times]
        assert held_pages(now, left, ps, times).tolist() == brute
        # the most of the head that fits: what a search over predicted_peak finds
        cap = int(rng.integers(0, 400))
        peaks = [predicted_peak(np.r_[now, hnow[:j]], np.r_[left, hleft[:j]], ps)
                 for j in range(1, k + 1)]
        want = next((j for j, p in enumerate(peaks) if p > cap), k)
        assert _fitting_prefix(now, left, hnow, hleft, ps, cap) == want
