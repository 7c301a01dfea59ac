"""Forms each iteration's dense batch: running decodes first, then chunked prefill.

NanoFlow keeps the batch at B_dense tokens: every running decode gets its one token, and
prefill chunks from a FIFO queue fill the rest. Admission only takes a request when the
pages for its whole prompt (plus one for growth) are free after what running requests
still need; when a decode needs a page and none is free, the newest running request is
preempted (recompute: its pages are freed and it re-enters the queue at the front).

With a prefix cache, an admitted request first takes the cached pages of its leading
tokens (shared read-only, see prefix_cache.py) and pages an offload tier holds (loaded into
fresh pages before its step: `take_loads`), and prefills only the rest.

`admission="predicted"` is NanoFlow's memory-usage prediction on top: a request is also
admitted only if every running request plus it, each grown to its expected final length,
fits the cache. The expected output is max_tokens where nothing can stop a request
earlier, else the mean of finished requests' outputs (max_tokens until one finishes).
With every request arriving at once, greedy admission fills the cache with prompts and
then preempts decodes by the hundred (H200, 1,024 requests: 227 preemptions, batches 43%
full); predicted admission runs fewer requests at a time and keeps them.
"""
from __future__ import annotations

import collections
import dataclasses

from nanojax.config import ADMISSION
from nanojax.engine.kv_cache import OutOfPages, PageAllocator, pages_needed
from nanojax.engine.prefix_cache import PrefixCache, PrefixMatch
from nanojax.engine.sequence import Sequence, Status
from nanojax.errors import ConfigError


@dataclasses.dataclass
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

    @property
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
        self._loads: list[tuple[list[int], list]] = []  # (fresh pages, tier entries)

    # ---- queue management ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its pages."""
        if seq.finish_reason in ("stop", "length"):
            self.finished_outputs += len(seq.output_ids)
            self.finished_count += 1
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

    def take_loads(self) -> list[tuple[list[int], list]]:
        """Offload-tier pages admitted this iteration: (pages, entries) to copy in before
        the step is launched."""
        loads, self._loads = self._loads, []
        return loads

    def _preempt(self, seq: Sequence) -> None:
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
            for seq in self.running:
                self.prefix_cache.register(seq)

        # 1. decodes: every running request whose prompt is fully in the cache
        for seq in list(self.running):
            if seq not in self.running or seq.num_computed < seq.num_known:
                continue
            if seq.num_generated >= seq.params.max_tokens or seq.num_total >= self.max_model_len:
                continue  # its last token is in flight; it retires when that is read
            if seq.num_computed != seq.num_total - 1:
                continue
            if not self._grow_or_preempt(seq, seq.num_total, scheduled):
                continue
            row = prev_rows.get(id(seq), -1) if seq.pending else -1
            entries.append(BatchEntry(seq, seq.num_computed, 1, True, row))
            scheduled.add(id(seq))
            budget -= 1
        num_decodes = len(entries)

        # 2. running requests part-way through their prompt
        for seq in list(self.running):
            if budget <= 0 or len(entries) - num_decodes >= self.max_prefill_seqs:
                break
            if seq not in self.running or id(seq) in scheduled:
                continue
            if seq.num_computed >= seq.num_known:
                continue
            chunk = self._chunk(seq.num_known - seq.num_computed, budget)
            if not self._grow_or_preempt(seq, seq.num_computed + chunk, scheduled):
                continue
            entries.append(self._prefill_entry(seq, chunk))
            scheduled.add(id(seq))
            budget -= chunk

        # 3. admit from the queue, first come first served
        while (budget > 0 and self.waiting and len(self.running) < self.max_num_seqs
               and len(entries) - num_decodes < self.max_prefill_seqs):
            seq = self.waiting[0]
            if seq.pending:  # preempted with a token still on the device: next iteration
                break
            match = self._match(seq)
            if not self._admissible(seq, match):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._take_prefix(seq, match)
            chunk = self._chunk(seq.num_known - seq.num_computed, budget)
            ok = self._grow(seq, seq.num_computed + chunk)
            assert ok, "admission checked the pages"
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
        entries = pc.tier.fetch(match.tier_hashes) if match.tier_hashes else []
        match.tier_hashes = match.tier_hashes[:len(entries)]
        pc.count(seq, match)
        if entries:
            fresh = self.allocator.allocate(len(entries))
            seq.pages += fresh
            for p, h in zip(fresh, match.tier_hashes):
                self.allocator.register(p, h)  # the copy in is launched before any reader
            self._loads.append((fresh, entries))
        seq.num_computed = len(seq.pages) * self.page_size
        seq.num_cached_pages = len(seq.pages)

    def _admissible(self, seq: Sequence, match: PrefixMatch) -> bool:
        """Pages for its whole known context plus one (less the cached pages it shares),
        after what running requests still need to finish their prompts and one page of
        growth per running decode; with predicted admission, also room for everyone's
        expected final length."""
        owed = sum(pages_needed(s.num_known + 1, self.page_size) - len(s.pages)
                   for s in self.running)
        shared = match.gpu_pages
        need = pages_needed(seq.num_known + 1, self.page_size) - len(shared)
        need += sum(self.allocator.refcount[p] == 0 for p in shared)  # leave the free list
        if need + owed + len(self.running) > self.allocator.num_free:
            return False
        if self.admission == "predicted" and self.running:
            peak = sum(pages_needed(self.expected_length(s), self.page_size)
                       for s in (*self.running, seq))
            return peak <= self.allocator.num_pages
        return True

    def expected_length(self, seq: Sequence) -> int:
        """Tokens seq will hold when it finishes: prompt + max_tokens when nothing can stop
        it earlier (ignore_eos, no stop strings), else prompt + the mean finished output
        (max_tokens before any finished); never beyond max_model_len, never below what it
        already holds."""
        prompt = len(seq.prompt_ids)
        out = seq.params.max_tokens
        can_stop = not seq.params.ignore_eos or seq.params.stop or seq.params.stop_token_ids
        if can_stop and self.finished_count:
            out = min(out, -(-self.finished_outputs // self.finished_count))
        return max(seq.num_total + 1, min(prompt + out, self.max_model_len))
