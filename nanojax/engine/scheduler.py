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
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging

import numpy as np

from nanojax.config import ADMISSION
from nanojax.engine.kv_cache import OutOfPages, PageAllocator, pages_needed
from nanojax.engine.prefix_cache import PrefixCache, PrefixMatch
from nanojax.engine.sequence import Sequence, Status
from nanojax.errors import ConfigError

log = logging.getLogger(__name__)


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

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


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
        self.running: list[Sequence] = []   # admission order: newest last
        self.num_preemptions = 0
        self.prefix_cache = prefix_cache
        self.max_prefill_seqs = max_prefill_seqs or b_dense
        self._loads: list = []  # staged tier pages to copy in before this step
        self._credit = 1.0  # predicted admission: requests its pace lets in now

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
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

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
        self.running.remove(seq)
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

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, scheduled: set) -> bool:
        """Pages for seq, preempting the newest unscheduled running request if needed."""
        while not self._grow(seq, num_tokens):
            victims = [s for s in self.running if id(s) not in scheduled]
            if not victims:
                return False
            victim = victims[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    # ---- one iteration ------------------------------------------------------------------
    def schedule(self, prev_rows: dict[int, int] | None = None) -> ScheduledBatch:
        prev_rows = prev_rows or {}
        entries: list[BatchEntry] = []
        scheduled: set[int] = set()
        budget = self.b_dense
        if self.prefix_cache is not None:  # pages completed by the steps launched so far
            ps = self.page_size
            for seq in self.running:  # (most have no new full page: skip them here)
                # a load in flight: its pages hold nothing yet
                if seq.loading is None and seq.num_computed // ps > seq.num_cached_pages:
                    self.prefix_cache.register(seq)

        # 1. decodes: every running request whose prompt is fully in the cache. Per
        # request only a few attribute reads: at 1,000 running requests this loop is much
        # of the host's time per iteration (a status check, not `seq in self.running`,
        # which made it quadratic: bench/results/log/engine_host.md)
        prefilling = []
        running, page_size, max_len = Status.RUNNING, self.page_size, self.max_model_len
        for seq in list(self.running):
            if seq.status is not running:
                continue  # preempted by an earlier one's growth
            outputs = len(seq.output_ids)
            known = len(seq.prompt_ids) + outputs
            if seq.num_computed < known:
                prefilling.append(seq)
                continue
            total = known + seq.pending
            if outputs + seq.pending >= seq.params.max_tokens or total >= max_len:
                continue  # its last token is in flight; it retires when that is read
            if seq.num_computed != total - 1:
                continue
            if (total > len(seq.pages) * page_size  # a new page: allocate (or preempt)
                    and not self._grow_or_preempt(seq, total, scheduled)):
                continue
            row = prev_rows.get(id(seq), -1) if seq.pending else -1
            entries.append(BatchEntry(seq, seq.num_computed, 1, True, row))
            scheduled.add(id(seq))
            budget -= 1
        num_decodes = len(entries)

        # 2. running requests part-way through their prompt
        for seq in prefilling:
            if budget <= 0 or len(entries) - num_decodes >= self.max_prefill_seqs:
                break
            if seq.status is not Status.RUNNING or not self._loaded(seq):
                continue
            chunk = self._chunk(seq.num_known - seq.num_computed, budget)
            if not self._grow_or_preempt(seq, seq.num_computed + chunk, scheduled):
                continue
            entries.append(self._prefill_entry(seq, chunk))
            scheduled.add(id(seq))
            budget -= chunk

        # 3. admit from the queue, first come first served; predicted admission at its
        # pace (`_Room.pace`)
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
        while (budget > 0 and self.waiting and len(self.running) < self.max_num_seqs
               and len(entries) - num_decodes < self.max_prefill_seqs):
            seq = self.waiting[0]
            if seq.pending:  # preempted with a token still on the device: next iteration
                break
            if self.admission == "predicted" and self.running and self._credit < 1:
                break
            room = room or _Room(self)
            match = self._match(seq)
            if not self._admissible(seq, match, room):
                break
            self._credit = max(0.0, self._credit - 1)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._take_prefix(seq, match)
            if seq.loading is not None:  # scheduled once its tier pages are staged
                room.add(self, seq)
                continue
            chunk = self._chunk(seq.num_known - seq.num_computed, budget)
            ok = self._grow(seq, seq.num_computed + chunk)
            assert ok, "admission checked the pages"
            room.add(self, seq)
            entries.append(self._prefill_entry(seq, chunk))
            scheduled.add(id(seq))
            budget -= chunk

        for e in entries:
            e.seq.num_computed += e.num_tokens
            if e.samples:
                e.seq.pending += 1
        return ScheduledBatch(entries, num_decodes)

    def _chunk(self, wanted: int, budget: int) -> int:
        """Tokens of a prefill chunk starting at the batch position b_dense - budget."""
        pos = self.b_dense - budget
        room = next((c - pos for c in self.chunk_cuts if c > pos), budget)
        return min(wanted, budget, room)

    def _prefill_entry(self, seq: Sequence, chunk: int) -> BatchEntry:
        samples = seq.num_computed + chunk == seq.num_known and seq.pending == 0
        return BatchEntry(seq, seq.num_computed, chunk, samples)

    def _match(self, seq: Sequence) -> PrefixMatch:
        if self.prefix_cache is None:
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


def predicted_peak(now: np.ndarray, remaining: np.ndarray, page_size: int) -> int:
    """Most pages the requests will hold at once if request i, holding now[i] tokens,
    grows one token per iteration and frees its pages after remaining[i] more: the usage
    only drops when one finishes, so the peak is at a finishing time r, where the
    requests with remaining >= r hold ceil((now + r) / page_size) pages each."""
    if not len(now):
        return 0
    order = np.argsort(remaining, kind="stable")
    r, now = remaining[order], now[order]
    alive = np.arange(len(r), 0, -1)                   # requests k.. (sorted by r)
    tokens = np.cumsum(now[::-1])[::-1] + alive * r    # what they hold at time r[k]
    # rounding up to whole pages, by residue of now mod page_size: counts per residue
    # of the requests k.., and the padding each residue needs at time r[k]
    residue = np.zeros((len(r), page_size), np.int64)
    residue[np.arange(len(r)), now % page_size] = 1
    counts = np.cumsum(residue[::-1], axis=0)[::-1]
    pad = -(np.arange(page_size)[None, :] + r[:, None]) % page_size
    return int(np.max((tokens + (counts * pad).sum(axis=1)) // page_size))


# iterations' worth of pace saved up while requests wait but cannot be admitted (cache,
# rows or batch full), so that a burst of finishing requests is replaced at once (trace
# workloads, whose requests finish unevenly: saving one iteration's worth only took more
# iterations on sharegpt and lmsys in the scheduler simulation, `nanojax bench schedule`)
_PACE_SAVED = 16


class _Room:
    """What the running requests hold and owe, gathered once per admission phase and kept
    current as requests are admitted: pages still owed to running prompts (plus one), and
    with predicted admission each request's prompt, tokens now and expected final length
    (for the predicted peak and the pace)."""

    def __init__(self, sched: Scheduler):
        self.owed = 0
        self.all_waiting_fit = False  # set by the admission phase (all_fit)
        self._lengths: list[tuple[int, int, int]] = []  # (prompt, now, expected final)
        self.admitted = 0  # requests admitted this iteration (added after the running)
        # next_fits(): how many of the queue's head fit, counted from the _offset-th
        # request admitted this iteration
        self._fits: int | None = None
        self._offset = 0  # set with _fits
        # every running request, as add() would take them one by one (inlined: this runs
        # over every running request every iteration)
        ps, max_len, predicted = sched.page_size, sched.max_model_len, \
            sched.admission == "predicted"
        mean = (-(-sched.finished_outputs // sched.finished_count)
                if sched.finished_count else None)
        owed, lengths = 0, self._lengths
        for s in sched.running:
            prompt, known = len(s.prompt_ids), len(s.prompt_ids) + len(s.output_ids)
            owed += -(-(known + 1) // ps) - len(s.pages)
            if predicted:
                out = s.params.max_tokens
                if s.can_stop and mean is not None:
                    out = min(out, mean)
                total = known + s.pending
                lengths.append((prompt, total, max(total + 1, min(prompt + out, max_len))))
        self.owed = owed

    def add(self, sched: Scheduler, seq: Sequence) -> None:
        """seq admitted this iteration."""
        self.owed += pages_needed(seq.num_known + 1, sched.page_size) - len(seq.pages)
        self.admitted += 1
        if sched.admission == "predicted":
            self._lengths.append((len(seq.prompt_ids), seq.num_total,
                                  sched.expected_length(seq)))

    def next_fits(self, sched: Scheduler) -> bool:
        """Whether the head of the queue fits the cache at the predicted peak beside the
        running requests and the ones admitted before it. How many of the queue's head
        fit is found once per iteration, at the first candidate: adding a request never
        lowers the peak, so it is a binary search over the head (as far as the pace lets
        in), not one peak per candidate (at 4,000 running, most of the host's time)."""
        if self._fits is None:
            self._offset = self.admitted
            base = np.asarray(self._lengths, np.int64).reshape(-1, 3)
            n = len(base)
            most = min(len(sched.waiting), max(1, int(sched._credit)),
                       sched.max_num_seqs - n)
            head = np.asarray([(s.num_total, sched.expected_length(s)) for s in
                               itertools.islice(sched.waiting, max(0, most))],
                              np.int64).reshape(-1, 2)
            now = np.concatenate([base[:, 1], head[:, 0]])
            left = np.concatenate([base[:, 2], np.maximum(head[:, 1], head[:, 0] + 1)]) - now

            def fits(k: int) -> bool:
                return predicted_peak(now[:n + k], left[:n + k], sched.page_size) \
                    <= sched.allocator.num_pages

            lo, hi = 0, len(head)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            self._fits = lo
        return self.admitted - self._offset < self._fits

    def all_fit(self, sched: Scheduler) -> bool:
        """Whether every waiting request, admitted now, fits beside the running ones: in
        the row cap, and in the cache at the predicted peak of all of them."""
        if len(sched.running) + len(sched.waiting) > sched.max_num_seqs:
            return False
        a = np.asarray(self._lengths + [(0, s.num_total, sched.expected_length(s))
                                        for s in sched.waiting], np.int64)
        return predicted_peak(a[:, 1], a[:, 2] - a[:, 1], sched.page_size) \
            <= sched.allocator.num_pages

    def pace(self, sched: Scheduler, head: Sequence) -> float:
        """Requests per iteration the cache and the row cap can sustain (Little's law):
        N of them at once, each staying its output length (+1: it is retired an iteration
        late), are replaced at N x the mean of 1 / stay; N is the cache over the mean
        tokens a request holds during its stay (prompt + half its output, + half a page)
        or max_num_seqs, the smaller. Estimated from the running requests (the head of the
        queue when none runs)."""
        lengths = self._lengths or [(len(head.prompt_ids), head.num_total,
                                     sched.expected_length(head))]
        a = np.asarray(lengths, np.float64)
        out = a[:, 2] - a[:, 0]
        held = float(np.mean(a[:, 0] + out / 2)) + sched.page_size / 2
        at_once = min(sched.allocator.num_pages * sched.page_size / held, sched.max_num_seqs)
        return float(at_once * np.mean(1 / (out + 1)))
