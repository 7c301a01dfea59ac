"""Forms each iteration's dense batch: running decodes first, then chunked prefill.

NanoFlow keeps the batch at B_dense tokens: every running decode gets its one token, and
prefill chunks from a FIFO queue fill the rest. Admission only takes a request when the
pages for its whole prompt (plus one for growth) are free after what running requests
still need; when a decode needs a page and none is free, the newest running request is
preempted (recompute: its pages are freed and it re-enters the queue at the front).

With a prefix cache, an admitted request first takes the cached pages of its leading
tokens (shared read-only, see prefix_cache.py) and pages an offload tier holds, and
prefills only the rest. The tier's pages are staged on the device in the background (host
rows to device memory, off the engine thread); the request waits in `running` until they
are, then its copy into fresh pages goes out before its first step (`take_loads`).

`admission="predicted"` is NanoFlow's memory-usage prediction on top: a request is also
admitted only if the predicted peak of the cache, with every running request plus it
growing one token per iteration to its expected final length and freeing its pages when
it finishes, fits. The expected output is max_tokens where nothing can stop a request
earlier, else the mean of finished requests' outputs (max_tokens until one finishes).
Requests finish at different times, so the peak is the largest, over the finishing
times r, of the pages held at r by the requests still running then (`predicted_peak`);
reserving every request's final length at once (the sum of final lengths) admits a
quarter fewer 512/512 requests than the cache holds in steady state (1,024 tokens each
instead of ~776 on average), which caps the decodes below B_dense / 2 and the batch
below full. With every request arriving at once, greedy admission fills the cache with
prompts and then preempts decodes by the hundred, leaving the batches under half full
(measured on the H200: bench/results/archive/README.md); predicted admission keeps them.

Predicted admission also paces itself where there is a backlog (more requests running
and waiting than the rows and the cache's predicted peak hold at once, `_Room.all_fit`):
no faster than the requests it can hold at once can be replaced (`_Room.pace`). Admitting
a backlog as fast as prefill allows fills the cache with requests of nearly the same age;
they finish together, and until their replacements have prefilled the batch is decodes
only, about half full for 512/512, again each time that cohort comes round. A burst that
fits at once has no replacements to wait for and goes in as fast as prefill allows.

Where the batch is not full (the KV cache bounds the decodes, as at 1000/1000 on one
card), a step runs at the compiled token count above its tokens, padding included: ~440
decodes and a 1,000-token prompt launch 2,048. With the engine's shapes given
(`step_shapes`, EngineConfig.fit_step_shapes), the prompt's tail waits a step where that
launches this one at the next smaller shape, fewer tokens waiting than the larger shape
would pad and no more than go now (`_fit_to_shape`). Where the cache, the rows or the
pace keep the queue out (not the step's tokens), the prompts left are spread instead
(`prefill_spread` steps, EngineConfig.prefill_spread): each step launches at the smallest
shape that holds its decodes and 1/prefill_spread of those prompts, filled with prefill.
Taking a new prompt whole leaves the steps after it decodes alone, padded to the shape
above them (2048/2048 on an H100: ~295 decodes launched as 512, one step in six a
2,048-token prefill: 1.25x the tokens); spread, 1.01x in a steady window on the GPU
(bench/results/log/fp8.md §95). Where the queue waits for the step's tokens, holding
prefill back would hold admission back with it, so the batch is left to fill; where the
queue is empty, a lone prompt goes in at once.

An iteration's host cost follows what changed, not what runs (issue 43): the running
requests' numbers are columns of arrays (`_Rows`), written where a request joins or leaves,
gains a page or a prefill chunk; the decodes, the pages they need, the room, the predicted
peak and the pace are computed over those columns, and Python runs per request only where
one changed and for the batch's entries (bench/results/host_loop/schedule_ab_cpu.json).
"""
from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import operator
from typing import NamedTuple

import numpy as np

from nanojax.config import ADMISSION
from nanojax.engine.kv_cache import OutOfPages, PageAllocator, pages_needed
from nanojax.engine.prefix_cache import PrefixCache, PrefixMatch
from nanojax.engine.sequence import Sequence, Status
from nanojax.errors import ConfigError

log = logging.getLogger(__name__)

# prompt tokens one step scores at most (prompt_logprobs: a row of logits over the
# vocabulary each); a longer prompt that asks is prefilled in chunks of this size
MAX_SCORED_TOKENS = 512
# prefill spreading runs where the batch is not full: its mean fill (an average over ~10
# iterations) below this (a full batch has no padding to fill)
SPREAD_BELOW_FILL, FILL_AVERAGING = 0.9, 0.1


@dataclasses.dataclass(slots=True)
class BatchEntry:
    seq: Sequence
    start: int            # position of the entry's first token
    num_tokens: int
    samples: bool         # the chunk ends at the newest token: sample the next one
    prev_row: int = -1    # decode whose input is still on the device: its row last step


@dataclasses.dataclass
class ScheduledBatch:
    entries: list[BatchEntry]
    num_decodes: int
    # the entries' requests' keys (Scheduler._key_of), row by row: where the next
    # schedule() finds the rows of its decodes' newest tokens without a dict per step
    keys: np.ndarray | None = None

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class RowView(NamedTuple):
    """The running requests' numbers, one element per request in `Scheduler.running`
    order: views into _Rows' storage (writes go through; stale after an append or delete)."""
    key: np.ndarray         # the scheduler's key for its stay (ascending: admission order)
    prompt: np.ndarray      # len(prompt_ids)
    total: np.ndarray       # num_total: prompt, outputs and the tokens still on the device
    computed: np.ndarray    # num_computed
    pages: np.ndarray       # len(pages)
    cached: np.ndarray      # num_cached_pages
    loading: np.ndarray     # 1 while an offload tier's pages are on their way in
    max_tokens: np.ndarray
    can_stop: np.ndarray


class _Rows:
    """RowView's columns, kept in step with `Scheduler.running`: a request's column is
    written when it joins and where the scheduler changed it (a page, a prefill chunk,
    its decode: vectorized), and deleted when it leaves, so an iteration reads every
    running request's state from arrays instead of from its Sequence. Its outputs and
    `pending` change outside the scheduler, but their sum does not (a token read from the
    device moves from pending to the outputs): `total` is the scheduler's own; `pending`
    itself is gathered where it is needed."""

    def __init__(self, capacity: int = 64):
        self._a = np.zeros((len(RowView._fields), capacity), np.int64)
        self.n = 0
        self._view: RowView | None = None  # view()'s, until the next append or delete

    def view(self) -> RowView:
        if self._view is None:
            self._view = RowView(*self._a[:, :self.n])
        return self._view

    def find(self, key: int) -> int:
        """The position of the request with this key."""
        return int(np.searchsorted(self._a[0, :self.n], key))

    def append(self, key: int, seq: Sequence) -> None:
        if self.n == self._a.shape[1]:
            self._a = np.concatenate([self._a, np.zeros_like(self._a)], axis=1)
        self.n += 1
        self._view = None
        self.write(self.n - 1, key, seq)

    def write(self, i: int, key: int, seq: Sequence) -> None:
        self._a[:, i] = (key, len(seq.prompt_ids), seq.num_total, seq.num_computed,
                         len(seq.pages), seq.num_cached_pages, seq.loading is not None,
                         seq.params.max_tokens, seq.can_stop)

    def delete(self, i: int) -> None:
        """Columns after i move up one (a tail delete leaves the others in place)."""
        self._a[:, i:self.n - 1] = self._a[:, i + 1:self.n]
        self.n -= 1
        self._view = None


# a request's fields, gathered over many with map() (C-level: no Python loop per request)
_PENDING = operator.attrgetter("pending")
_PROMPT_IDS = operator.attrgetter("prompt_ids")
_OUTPUT_IDS = operator.attrgetter("output_ids")
_MAX_TOKENS = operator.attrgetter("params.max_tokens")
_CAN_STOP = operator.attrgetter("can_stop")


def _nonzero(mask: np.ndarray) -> np.ndarray:
    return mask.nonzero()[0]


def _pending(seqs: list[Sequence]) -> np.ndarray:
    """Each request's tokens still on the device."""
    return np.fromiter(map(_PENDING, seqs), np.int64, len(seqs))


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, b_dense: int,
                 max_num_seqs: int, max_model_len: int, chunk_cuts: tuple[int, ...] = (),
                 admission: str = "greedy", prefix_cache: PrefixCache | None = None,
                 max_prefill_seqs: int | None = None):
        """chunk_cuts: positions in the dense batch that no prefill chunk may straddle (the
        forward's attention nano-batch boundaries: a nano-batch then holds whole chunks,
        so the nano-batches' attention can run in any order). admission: "greedy" or
        "predicted" (see the module docstring). max_prefill_seqs: most sequences that
        prefill in one iteration (the chunked-prefill kernel's bound; None: no limit)."""
        if admission not in ADMISSION:
            raise ConfigError(f"admission must be one of {ADMISSION}, got {admission!r}")
        self.admission = admission
        self.finished_outputs, self.finished_count = 0, 0  # for the expected output length
        self.allocator = allocator
        self.chunk_cuts = sorted(c for c in chunk_cuts if 0 < c < b_dense)
        self.page_size = page_size
        self.b_dense = b_dense
        self.max_num_seqs = min(max_num_seqs, b_dense)
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        # admission order, newest last; change it only through _start/_stop_running,
        # which keep _rows (its numbers, column by column) and _key_of in step
        self.running: list[Sequence] = []
        self._rows = _Rows(self.max_num_seqs)
        self._key_of: dict[Sequence, int] = {}  # a running request's key in _rows
        self._keys = itertools.count()          # a new key per stay (a restart is a new one)
        self.num_preemptions = 0
        self.prefix_cache = prefix_cache
        self.max_prefill_seqs = max_prefill_seqs or b_dense
        self._loads: list = []  # staged tier pages to copy in before this step
        self._credit = 1.0  # predicted admission: requests its pace lets in now
        self._scored_left = MAX_SCORED_TOKENS  # this step's room for prompt_logprobs
        # the token counts a step is launched with, ascending (the engine's compiled
        # shapes); set: a step's prefill tail may wait to save padding (_fit_to_shape)
        self.step_shapes: tuple[int, ...] = ()
        # with step_shapes, where the batch is not full: the prompts left are spread over
        # this many steps, each launched at a shape without padding (0: off)
        self.prefill_spread = 0
        self._fill = 1.0  # the batch's mean fill (tokens / b_dense), lately
        self._queue_held = False  # this step's queue kept out by the cache, rows or pace

    # ---- queue management ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its pages."""
        if seq.finish_reason in ("stop", "length"):
            self.finished_outputs += len(seq.output_ids)
            self.finished_count += 1
        self._drop_load(seq)
        if self.prefix_cache is not None:  # its last full pages stay cached
            self.prefix_cache.register(seq)
        if not self._stop_running(seq) and seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _start_running(self, seq: Sequence) -> None:
        key = next(self._keys)
        self._key_of[seq] = key
        self.running.append(seq)
        self._rows.append(key, seq)

    def _stop_running(self, seq: Sequence) -> bool:
        """Takes seq out of running (False: it was not running)."""
        key = self._key_of.pop(seq, None)
        if key is None:
            return False
        i = self._rows.find(key)
        assert self.running[i] is seq, "running changed outside the scheduler"
        del self.running[i]
        self._rows.delete(i)
        return True

    def _sync(self, seq: Sequence) -> None:
        """Rewrites a running request's column after the scheduler changed it."""
        key = self._key_of[seq]
        self._rows.write(self._rows.find(key), key, seq)

    def _free(self, seq: Sequence) -> None:
        if seq.pages:
            self.allocator.free(seq.pages[::-1])  # tail first: a prefix outlives its tail
            seq.pages = []
        seq.num_cached_pages = 0

    def _drop_load(self, seq: Sequence) -> None:
        """A request leaving (or restarting) before its tier pages arrived: they are
        dropped and never cached (its pages are freed or recomputed)."""
        if seq.loading is not None:
            seq.loading.cancel()
            seq.loading = None
            seq.num_computed = seq.num_cached_pages * self.page_size

    def _loaded(self, seq: Sequence) -> bool:
        """Whether seq may be scheduled: no load in flight, or its load staged (then its
        copy in goes out with this step); a failed staging recomputes those pages."""
        if seq.loading is None:
            return True
        if not seq.loading.done():
            return False
        fut, seq.loading = seq.loading, None
        try:
            self._loads.append(fut.result())
        except Exception:  # staging failed: recompute, never serve a page not loaded
            log.exception("staging %s's offloaded pages failed; recomputing them",
                          seq.request_id)
            seq.num_computed = seq.num_cached_pages * self.page_size
        return True

    def wait_for_loads(self, timeout: float) -> None:
        """Blocks until a running request's staged load is done (or timeout)."""
        futures = [s.loading for s in self.running if s.loading is not None]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def take_loads(self) -> list:
        """Tier pages staged on the device whose requests run this step: to copy into
        their pages before the step is launched (KVOffloader.load)."""
        loads, self._loads = self._loads, []
        return loads

    def _preempt(self, seq: Sequence) -> None:
        self._drop_load(seq)
        self._stop_running(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = pages_needed(num_tokens, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        try:
            seq.pages.extend(self.allocator.allocate(need))
            return True
        except OutOfPages:
            return False

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int,
                         entries: list[BatchEntry]) -> bool:
        """Pages for seq, preempting the newest running request not in entries if needed."""
        while not self._grow(seq, num_tokens):
            scheduled = {id(e.seq) for e in entries}  # (only when short of pages)
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    # ---- one iteration ------------------------------------------------------------------
    def schedule(self, prev: ScheduledBatch | dict[int, int] | None = None) -> ScheduledBatch:
        """The next batch. prev: the batch still on the device, whose rows hold the
        newest tokens of the decodes in it (or a dict {id(seq): its row there})."""
        if self.prefix_cache is not None:
            self._register_full_pages(self.prefix_cache)
        entries, decode_keys, prefilling = self._decodes(prev)
        self._scored_left = MAX_SCORED_TOKENS
        num_decodes = len(entries)
        budget = self._prefills(prefilling, entries, self.b_dense - num_decodes)
        budget = self._admit(entries, budget, num_decodes)
        if self.step_shapes:  # (entries only grow above: b_dense - budget tokens)
            total = self.b_dense - budget
            if not (self._queue_held and self._may_spread()
                    and self._spread_to_shape(entries, num_decodes, total, prefilling)):
                self._fit_to_shape(entries, num_decodes, total)
        batch = self._advance(entries, decode_keys)
        self._fill += FILL_AVERAGING * (batch.num_tokens / self.b_dense - self._fill)
        return batch

    def _fit_to_shape(self, entries: list[BatchEntry], num_decodes: int, total: int) -> None:
        """4. the prefill's tail waits a step where that launches this one at the next
        smaller shape: when fewer tokens wait than the larger shape would pad, and no
        more wait than go now (a prompt is never held to a trickle). A KV-bound 1000/1000
        step of ~440 decodes and a 1,000-token prompt runs 1,024 tokens, then the rest
        with the next decodes, not 2,048 (~600 of them padding) and then 512."""
        lower = [s for s in self.step_shapes if s < total]
        upper = next((s for s in self.step_shapes if s >= total), None)
        if not lower or upper is None:
            return
        wait = total - lower[-1]
        if wait >= upper - total or 2 * wait > total - num_decodes:
            return
        self._hold_back(entries, wait)

    def _spread_to_shape(self, entries: list[BatchEntry], num_decodes: int, total: int,
                         prefilling: list[Sequence]) -> bool:
        """4'. where the queue waits for the cache, the rows or the pace and the batch is
        not full: the step launches at the smallest shape that holds its decodes and
        1/prefill_spread of the prompts left (the module docstring), the rest of them
        waiting for the next steps. False where that cuts nothing."""
        scheduled = {id(e.seq) for e in entries[num_decodes:]}
        backlog = sum(e.seq.num_known - e.seq.num_computed for e in entries[num_decodes:])
        backlog += sum(s.num_known - s.num_computed for s in prefilling  # (not preempted)
                       if id(s) not in scheduled and s.status is Status.RUNNING)
        shapes = self.step_shapes
        want = num_decodes + -(-backlog // self.prefill_spread)
        target = shapes[min(bisect.bisect_left(shapes, want), len(shapes) - 1)]
        if not num_decodes <= target < total:  # (only prefill is ever cut)
            return False
        self._hold_back(entries, total - target)
        return True

    def _hold_back(self, entries: list[BatchEntry], wait: int) -> None:
        """The newest prefill chunks give up wait tokens to the next step."""
        while wait:  # from the newest chunks (the decodes come first: never reached)
            e = entries[-1]
            cut = min(wait, e.num_tokens)
            e.num_tokens -= cut
            wait -= cut
            if not e.num_tokens:  # it stays running, and prefills next step
                entries.pop()
                self._sync(e.seq)  # (its pages grew for the chunk)
            else:
                e.samples = (e.start + e.num_tokens == e.seq.num_known
                             and e.seq.pending == 0)

    def _register_full_pages(self, prefix_cache: PrefixCache) -> None:
        """Pages completed by the steps launched so far go into the prefix cache (not
        while a load is in flight: its pages hold nothing yet)."""
        r = self._rows.view()
        due = (r.loading == 0) & (r.computed // self.page_size > r.cached)
        for i in _nonzero(due).tolist():  # (most have no new full page)
            seq = self.running[i]
            prefix_cache.register(seq)
            r.cached[i] = seq.num_cached_pages

    def _decodes(self, prev) -> tuple[list[BatchEntry], np.ndarray, list[Sequence]]:
        """1. decodes: every running request whose prompt is fully in the cache, one token
        each, in running order; found over the arrays. Python runs only for the requests
        that need a new page (one in page_size decodes) and to make the entries. Returns
        them, their keys and the requests part-way through their prompt."""
        running = self.running
        r = self._rows.view()
        pending = _pending(running)
        prefilling = r.computed < r.total - pending
        # its last token in flight: it retires when that is read; a decode's input is the
        # newest token, so computed is one short of total (a decode has pending >= 1)
        decode = (~prefilling & (r.total - r.prompt < r.max_tokens)
                  & (r.total < self.max_model_len) & (r.computed == r.total - 1))
        grow = decode & (r.total > r.pages * self.page_size)
        if grow.any():
            self._decode_pages(_nonzero(grow), r)
        alive = len(running)  # every request past it was preempted
        rows = _nonzero(decode[:alive])
        keys = r.key[rows]
        seqs = [running[i] for i in rows.tolist()]
        entries = list(map(BatchEntry, seqs, r.computed[rows].tolist(), itertools.repeat(1),
                           itertools.repeat(True), self._prev_rows(prev, seqs, keys)))
        return entries, keys, [running[i] for i in _nonzero(prefilling[:alive]).tolist()]

    def _decode_pages(self, rows: np.ndarray, r: RowView) -> None:
        """New pages for the decodes in these rows, whose newest token starts a page (one
        in page_size decodes): one allocation where the free pages cover them all (the
        same pages, in the same order, as one request at a time), else one at a time,
        preempting from the tail."""
        need = -(-r.total[rows] // self.page_size) - r.pages[rows]
        ends = np.cumsum(need)
        if ends[-1] <= self.allocator.num_free:
            pages = self.allocator.allocate(int(ends[-1]))
            for i, start, end in zip(rows.tolist(), (ends - need).tolist(), ends.tolist()):
                self.running[i].pages.extend(pages[start:end])
            r.pages[rows] += need
            return
        for i in rows.tolist():
            if i >= len(self.running):
                break  # preempted (from the tail) for an earlier one's page
            seq = self.running[i]
            if self._decode_page(seq, int(r.total[i])):
                r.pages[i] = len(seq.pages)  # (tail deletes leave column i in place)

    def _decode_page(self, seq: Sequence, total: int) -> bool:
        """A decode's new page, preempting the newest running request while none is
        free: that is the last one (every earlier one is scheduled or skipped, a later
        one unscheduled); False where it is seq itself."""
        while not self._grow(seq, total):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    @staticmethod
    def _prev_rows(prev, seqs: list[Sequence], keys: np.ndarray) -> list[int]:
        """The decodes' rows in prev (-1: the host has the token), found by key."""
        if not seqs or not prev:
            return [-1] * len(seqs)
        if isinstance(prev, dict):
            return [prev.get(id(s), -1) for s in seqs]
        if prev.keys is None:  # not one of this scheduler's batches
            where = {id(e.seq): row for row, e in enumerate(prev.entries)}
            return [where.get(id(s), -1) for s in seqs]
        order = np.argsort(prev.keys)
        ordered = prev.keys[order]
        at = np.minimum(np.searchsorted(ordered, keys), len(ordered) - 1)
        return np.where(ordered[at] == keys, order[at], -1).tolist()

    def _prefills(self, prefilling: list[Sequence], entries: list[BatchEntry],
                  budget: int) -> int:
        """2. running requests part-way through their prompt; returns the budget left."""
        num_decodes = len(entries)
        for seq in prefilling:
            if budget <= 0 or len(entries) - num_decodes >= self.max_prefill_seqs:
                break
            if seq.status is not Status.RUNNING or not self._loaded(seq):
                continue  # (preempted for an earlier one)
            chunk = self._chunk_of(seq, budget)
            if not chunk:  # its prompt's scoring waits for the next step
                continue
            if not self._grow_or_preempt(seq, seq.num_computed + chunk, entries):
                continue
            entries.append(self._prefill_entry(seq, chunk))
            self._sync(seq)  # its pages, for _Room
            budget -= chunk
        return budget

    def _admit(self, entries: list[BatchEntry], budget: int, num_decodes: int) -> int:
        """3. admit from the queue, first come first served; predicted admission at its
        pace (`_Room.pace`); returns the budget left."""
        room = None  # what running requests hold and owe; built when first needed
        if self.admission == "predicted":
            if not self.waiting:  # nothing saved up while idle; one arrival goes straight in
                self._credit = 1.0
            else:
                room = _Room(self)
                room.all_waiting_fit = room.all_fit(self)
                if room.all_waiting_fit:
                    # every request there is fits at once: none waits for another to
                    # finish, so there are no turns to spread; pacing would only hold
                    # the burst back (128 Mixtral requests: 1,020 iterations, not 545)
                    self._credit = float(len(self.waiting))
                else:
                    pace = room.pace(self, self.waiting[0])
                    self._credit = min(self._credit + pace, _PACE_SAVED * pace + 1)
        held = False  # the queue's head kept out for the cache, the rows or the pace
        while (budget > 0 and self.waiting and len(self.running) < self.max_num_seqs
               and len(entries) - num_decodes < self.max_prefill_seqs):
            seq = self.waiting[0]
            if seq.pending:  # preempted with a token still on the device: next iteration
                break
            if not self._scored_left and seq.scored_positions(seq.num_computed, 1):
                break  # this step scores no more prompt tokens
            room = room or _Room(self)
            match = self._let_in(seq, room)
            if match is None:
                held = True
                break
            self._credit = max(0.0, self._credit - 1)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self._take_prefix(seq, match)
            self._start_running(seq)
            if seq.loading is not None:  # scheduled once its tier pages are staged
                room.add(self, seq)
                continue
            chunk = self._chunk_of(seq, budget)
            ok = self._grow(seq, seq.num_computed + chunk)
            assert ok, "admission checked the pages"
            room.add(self, seq)
            entries.append(self._prefill_entry(seq, chunk))
            budget -= chunk
        else:  # the step's tokens or prefill rows ran out first (or the queue, or the rows)
            # (an empty queue holds nothing back: a lone prompt goes in at once)
            held = bool(self.waiting) and (len(self.running) >= self.max_num_seqs or (
                self._may_spread() and not self.waiting[0].pending
                and self._let_in(self.waiting[0], room or _Room(self)) is None))
        self._queue_held = held
        return budget

    def _let_in(self, seq: Sequence, room: "_Room") -> PrefixMatch | None:
        """seq's prefix match where the pace and the cache let it (the queue's head) in;
        None where either keeps it out."""
        if self.admission == "predicted" and self.running and self._credit < 1:
            return None
        match = self._match(seq)
        return match if self._admissible(seq, match, room) else None

    def _may_spread(self) -> bool:
        return bool(self.prefill_spread and self.step_shapes and self._fill < SPREAD_BELOW_FILL)

    def _advance(self, entries: list[BatchEntry], decode_keys: np.ndarray) -> ScheduledBatch:
        """The launched tokens count as computed (and a sampled one as pending), in the
        Sequences and in their columns: the decodes' at once, the rest one by one."""
        num_decodes = len(decode_keys)
        for e in entries[:num_decodes]:
            seq = e.seq
            seq.num_computed += 1
            seq.pending += 1
        r = self._rows.view()
        at = np.searchsorted(r.key, decode_keys)  # (decodes are never preempted)
        r.computed[at] += 1
        r.total[at] += 1
        rest = entries[num_decodes:]
        for e in rest:
            e.seq.num_computed += e.num_tokens
            if e.samples:
                e.seq.pending += 1
            self._sync(e.seq)
        keys = np.concatenate([decode_keys, np.fromiter(
            (self._key_of[e.seq] for e in rest), np.int64, len(rest))])
        batch = ScheduledBatch(entries, num_decodes, keys)
        batch.num_tokens = num_decodes + sum(e.num_tokens for e in rest)  # (not summed again)
        return batch

    def _chunk(self, wanted: int, budget: int) -> int:
        """Tokens of a prefill chunk starting at the batch position b_dense - budget."""
        pos = self.b_dense - budget
        room = next((c - pos for c in self.chunk_cuts if c > pos), budget)
        return min(wanted, budget, room)

    def _chunk_of(self, seq: Sequence, budget: int) -> int:
        """seq's next prefill chunk: what is left of it, within the budget, the cuts and
        the step's room for scored prompt tokens (which it takes)."""
        chunk = self._chunk(seq.num_known - seq.num_computed, budget)
        scored = len(seq.scored_positions(seq.num_computed, chunk))
        if scored > self._scored_left:  # all of the shorter chunk is scored
            chunk = scored = self._scored_left
        self._scored_left -= scored
        return chunk

    def _prefill_entry(self, seq: Sequence, chunk: int) -> BatchEntry:
        samples = seq.num_computed + chunk == seq.num_known and seq.pending == 0
        return BatchEntry(seq, seq.num_computed, chunk, samples)

    def _match(self, seq: Sequence) -> PrefixMatch:
        # a scored prompt runs in full: cached pages come without their logits
        if self.prefix_cache is None or seq.prompt_logprobs is not None:
            return PrefixMatch([], [])
        return self.prefix_cache.match(seq)

    def _take_prefix(self, seq: Sequence, match: PrefixMatch) -> None:
        """Shares the matched GPU pages, loads the tier's pages into fresh ones (as far as
        the tier can produce them intact), and starts the prefill after them."""
        pc = self.prefix_cache
        if pc is None:
            return
        for p in match.gpu_pages:  # before allocating: a cached-free page must not be evicted
            self.allocator.ref(p)
        seq.pages = list(match.gpu_pages)
        entries = (pc.tier.fetch(match.tier_hashes)
                   if match.tier_hashes and pc.tier is not None else [])
        match.tier_hashes = match.tier_hashes[:len(entries)]
        pc.count(seq, match)
        seq.num_cached_pages = len(seq.pages)
        if entries:  # cached (registered) once loaded, by the next register() after it
            fresh = self.allocator.allocate(len(entries))
            seq.pages += fresh
            assert pc.tier is not None  # the entries came from it
            seq.loading = pc.tier.stage(fresh, entries)
        seq.num_computed = len(seq.pages) * self.page_size

    def _admissible(self, seq: Sequence, match: PrefixMatch, room: "_Room") -> bool:
        """Pages for its whole known context plus one (less the cached pages it shares),
        after what running requests still need to finish their prompts and one page of
        growth per running decode; with predicted admission, also room for the predicted
        peak of everyone's pages (`predicted_peak`)."""
        shared = match.gpu_pages
        need = pages_needed(seq.num_known + 1, self.page_size) - len(shared)
        need += sum(map(self.allocator.is_free, shared))  # these leave the free count
        if need + room.owed + len(self.running) > self.allocator.num_free:
            return False
        # all_waiting_fit: the peak with every waiting request was checked this iteration,
        # and a subset of them cannot peak higher
        if self.admission == "predicted" and self.running and not room.all_waiting_fit:
            return room.next_fits(self)
        return True

    def expected_length(self, seq: Sequence) -> int:
        """Tokens seq will hold when it finishes: prompt + max_tokens when nothing can stop
        it earlier (ignore_eos, no stop strings), else prompt + the mean finished output
        (max_tokens before any finished); never beyond max_model_len, never below what it
        already holds."""
        prompt = len(seq.prompt_ids)
        out = seq.params.max_tokens
        if seq.can_stop and self.finished_count:
            out = min(out, -(-self.finished_outputs // self.finished_count))
        return max(seq.num_total + 1, min(prompt + out, self.max_model_len))

    def expected_lengths(self, prompt: np.ndarray, total: np.ndarray, max_tokens: np.ndarray,
                         can_stop: np.ndarray) -> np.ndarray:
        """expected_length over arrays of the requests' numbers."""
        out = max_tokens
        if self.finished_count:
            mean = -(-self.finished_outputs // self.finished_count)
            out = np.where(can_stop != 0, np.minimum(out, mean), out)
        return np.maximum(total + 1, np.minimum(prompt + out, self.max_model_len))

    def _lengths_of(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """num_total and expected_length of each of seqs (waiting ones: no columns)."""
        n = len(seqs)
        prompt = np.fromiter(map(len, map(_PROMPT_IDS, seqs)), np.int64, n)
        total = prompt + np.fromiter(map(len, map(_OUTPUT_IDS, seqs)), np.int64, n) \
            + _pending(seqs)
        return total, self.expected_lengths(
            prompt, total, np.fromiter(map(_MAX_TOKENS, seqs), np.int64, n),
            np.fromiter(map(_CAN_STOP, seqs), np.int64, n))


def predicted_peak(now: np.ndarray, remaining: np.ndarray, page_size: int) -> int:
    """Most pages the requests will hold at once if request i, holding now[i] tokens,
    grows one token per iteration and frees its pages after remaining[i] more: the usage
    only drops when one finishes, so the peak is at a finishing time r, where the
    requests with remaining >= r hold ceil((now + r) / page_size) pages each."""
    if not len(now):
        return 0
    return int(held_pages(now, remaining, page_size, np.unique(remaining)).max())


def held_pages(now: np.ndarray, remaining: np.ndarray, page_size: int,
               times: np.ndarray) -> np.ndarray:
    """Pages the requests of predicted_peak hold at each of `times` (ascending): request
    i, alive while remaining[i] >= t, holds q_i + ceil((c_i + t) / page_size) where
    now[i] = q_i page_size + c_i. Summed per time from a histogram of the requests by
    (the last time they are alive, c): O(requests + times x page_size), no matrix of
    requests x page_size."""
    ps, g = page_size, len(times)
    last = np.searchsorted(times, remaining, side="right") - 1  # -1: alive at none
    now, last = now[last >= 0], last[last >= 0]
    q, c = np.divmod(now, ps)
    # requests alive at times[j] (last >= j) by residue c, and the sum of their q
    by_residue = np.bincount(last * ps + c, minlength=g * ps).reshape(g, ps)
    alive = np.cumsum(by_residue[::-1], axis=0)[::-1]
    full = np.cumsum(np.bincount(last, q, minlength=g)[::-1])[::-1].astype(np.int64)
    part = (np.arange(ps) + times[:, None] + ps - 1) // ps  # ceil((c + t) / ps)
    return full + (alive * part).sum(axis=1)


# iterations' worth of pace saved up while requests wait but cannot be admitted (cache,
# rows or batch full), so that a burst of finishing requests is replaced at once (trace
# workloads, whose requests finish unevenly: saving one iteration's worth only took more
# iterations on sharegpt and lmsys in the scheduler simulation, `nanojax bench schedule`)
_PACE_SAVED = 16


class _Room:
    """What the running requests hold and owe, gathered once per admission phase and kept
    current as requests are admitted: pages still owed to running prompts (plus one), and
    with predicted admission each request's prompt, tokens now and expected final length
    (for the predicted peak and the pace). The running requests' part is read from the
    scheduler's arrays (_Rows), not request by request."""

    def __init__(self, sched: Scheduler):
        self.all_waiting_fit = False  # set by the admission phase (all_fit)
        self.admitted = 0  # requests admitted this iteration (added after the running)
        # next_fits(): how many of the queue's head fit, counted from the _offset-th
        # request admitted this iteration
        self._fits: int | None = None
        self._offset = 0  # set with _fits
        r = sched._rows.view()
        known = r.total - _pending(sched.running)
        self.owed = int((-(-(known + 1) // sched.page_size) - r.pages).sum())
        # (prompt, now, expected final): the running requests', as expected_length()
        # gives them, then the ones admitted this iteration
        self._running = np.zeros((0, 3), np.int64)
        self._added: list[tuple[int, int, int]] = []
        if sched.admission == "predicted":
            final = sched.expected_lengths(r.prompt, r.total, r.max_tokens, r.can_stop)
            self._running = np.stack([r.prompt, r.total, final], axis=1)

    def add(self, sched: Scheduler, seq: Sequence) -> None:
        """seq admitted this iteration."""
        self.owed += pages_needed(seq.num_known + 1, sched.page_size) - len(seq.pages)
        self.admitted += 1
        if sched.admission == "predicted":
            self._added.append((len(seq.prompt_ids), seq.num_total, sched.expected_length(seq)))

    def lengths(self) -> np.ndarray:
        """(prompt, now, expected final) of every request, running order then admitted."""
        if not self._added:
            return self._running
        return np.concatenate([self._running, np.asarray(self._added, np.int64)])

    def next_fits(self, sched: Scheduler) -> bool:
        """Whether the head of the queue fits the cache at the predicted peak beside the
        running requests and the ones admitted before it. How many of the queue's head
        fit is found once per iteration, at the first candidate: adding a request never
        lowers the peak, so the peaks with the first 1, 2, ... of the head (as far as the
        pace lets in) are one cumulative sum over them at every finishing time, not one
        predicted_peak per count (at 4,000 running, most of the host's time)."""
        if self._fits is None:
            self._offset = self.admitted
            base = self.lengths()
            most = min(len(sched.waiting), max(1, int(sched._credit)),
                       sched.max_num_seqs - len(base))
            now, final = sched._lengths_of(list(itertools.islice(sched.waiting, max(0, most))))
            self._fits = _fitting_prefix(base[:, 1], base[:, 2] - base[:, 1], now,
                                         final - now, sched.page_size, sched.allocator.num_pages)
        return self.admitted - self._offset < self._fits

    def all_fit(self, sched: Scheduler) -> bool:
        """Whether every waiting request, admitted now, fits beside the running ones: in
        the row cap, and in the cache at the predicted peak of all of them."""
        if len(sched.running) + len(sched.waiting) > sched.max_num_seqs:
            return False
        now, final = sched._lengths_of(list(sched.waiting))
        a = np.concatenate([self.lengths(), np.stack([np.zeros_like(now), now, final], axis=1)])
        return predicted_peak(a[:, 1], a[:, 2] - a[:, 1], sched.page_size) \
            <= sched.allocator.num_pages

    def pace(self, sched: Scheduler, head: Sequence) -> float:
        """Requests per iteration the cache and the row cap can sustain (Little's law):
        N of them at once, each staying its output length (+1: it is retired an iteration
        late), are replaced at N x the mean of 1 / stay; N is the cache over the mean
        tokens a request holds during its stay (prompt + half its output, + half a page)
        or max_num_seqs, the smaller. Estimated from the running requests (the head of the
        queue when none runs)."""
        lengths = self.lengths()
        if not len(lengths):
            lengths = np.asarray([(len(head.prompt_ids), head.num_total,
                                   sched.expected_length(head))])
        a = lengths.astype(np.float64)
        out = a[:, 2] - a[:, 0]
        held = float(np.mean(a[:, 0] + out / 2)) + sched.page_size / 2
        at_once = min(sched.allocator.num_pages * sched.page_size / held, sched.max_num_seqs)
        return float(at_once * np.mean(1 / (out + 1)))


def _fitting_prefix(now: np.ndarray, left: np.ndarray, head_now: np.ndarray,
                    head_left: np.ndarray, page_size: int, num_pages: int) -> int:
    """The most k such that the requests (now, left) with the first k of the head's
    predict a peak within num_pages (predicted_peak of them together). The peaks are
    taken at every finishing time of all of them: at a time that is no finishing time of
    a subset, its usage is at most that at its next one, so the maximum is the same."""
    if not len(head_now):
        return 0
    times = np.unique(np.concatenate([left, head_left]))
    base = held_pages(now, left, page_size, times)
    head = np.where(times <= head_left[:, None],  # each head request's pages at each time
                    (head_now[:, None] + times + page_size - 1) // page_size, 0)
    peaks = (base + np.cumsum(head, axis=0)).max(axis=1)  # with the first 1, 2, ... of them
    return int(np.searchsorted(peaks, num_pages, side="right"))  # (peaks never decrease)
