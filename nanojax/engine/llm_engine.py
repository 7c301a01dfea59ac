"""The engine loop: schedule, launch, read the previous step's tokens, retire requests.

With async scheduling (the default), iteration i+1 is formed and launched before the host
reads iteration i's sampled tokens: decode inputs that are still on the device are taken
from the previous step's output there. A request that finished in iteration i is retired
when i is read, one iteration late; its token from i+1 is discarded.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time

from typing import TYPE_CHECKING

import numpy as np
from jax.profiler import TraceAnnotation

from nanojax.config import HOST_ONLY_FIELDS, EngineConfig, Platform
from nanojax.engine.forward import Forward, default_forward
from nanojax.engine.gc_freeze import frozen_startup_objects
from nanojax.engine.kv_cache import PageAllocator, size_cache
from nanojax.engine.outputs import CompletionOutput, RequestOutput
from nanojax.engine.runner import MaskedStep, ModelRunner
from nanojax.engine.sampling import SamplingError, SamplingParams
from nanojax.engine.scheduler import ScheduledBatch, Scheduler
from nanojax.engine.sequence import Sequence, Status
from nanojax.engine.structured import (GrammarCompiler, StructuredOutputError,
                                       StructuredOutputsParams, bad_words_token_ids,
                                       banned_tokens, fixed_bitmask, token_mask,
                                       without_tokens)
from nanojax.errors import EngineDeadError, NanojaxError
from nanojax.layers.kv_fp8 import resolve_kv_cache_dtype
from nanojax.models.bundle import ModelBundle, cpu_params
from nanojax.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from nanojax.engine.kv_offload import KVOffloader
    from nanojax.engine.prefix_cache import PrefixCache


class RequestError(NanojaxError, ValueError):
    """A request the engine cannot take (too long, empty, duplicate id)."""


@dataclasses.dataclass
class EngineStats:
    prompt_tokens: int = 0        # prompt tokens run through the model (incl. recompute)
    generation_tokens: int = 0    # tokens sampled and kept
    steps: int = 0
    scheduled_tokens: int = 0     # tokens in the launched batches (their fill of B_dense)
    # where an iteration's wall time goes: the host forming, launching and retiring
    # batches, and the host waiting for the device's tokens (with async scheduling, the
    # device is the bottleneck while wait_s grows; the host while it stays near 0)
    host_s: float = 0.0
    wait_s: float = 0.0
    finished: dict = dataclasses.field(default_factory=dict)  # finish_reason -> count
    # a list to record one IterationRecord per launched iteration into (the benchmark's
    # steady-state report); None, the default, records nothing (a server runs for days)
    trace: list | None = None


@dataclasses.dataclass(slots=True)
class IterationRecord:
    """One launched iteration: its batch, the scheduler's queues after forming it, and its
    times (host_s, wait_s: of the step() call that launched it; launch_s: the part of
    host_s spent building and dispatching the step and its page loads; inputs_s: of it,
    building the step's host arrays (CPU work only: the rest is dispatch and transfers,
    which block only if they wait on the device); schedule_s: forming the batch;
    process_s: the rest of host_s, mostly reading the step before and turning its tokens
    into outputs; done_t: perf_counter when its tokens were read)."""
    tokens: int
    decodes: int
    waiting: int
    running: int
    preemptions: int  # so far (cumulative)
    host_s: float = 0.0
    wait_s: float = 0.0
    done_t: float | None = None
    launch_s: float = 0.0
    inputs_s: float = 0.0
    schedule_s: float = 0.0
    process_s: float = 0.0


class LLMEngine:
    def __init__(self, bundle: ModelBundle, config: EngineConfig | None = None,
                 forward: Forward | None = None):
        """forward: the step's model forward (default: default_forward of the config's
        kernels; the nano-batch executor, PipelineForward, for a plan)."""
        import jax
        self.bundle = bundle
        self.model_config = bundle.config
        self.tokenizer = bundle.tokenizer
        platform = Platform.current()
        cfg = config or EngineConfig()
        self.max_model_len = min(cfg.max_model_len, self.model_config.max_position_embeddings)
        self.kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, self.model_config.dtype)
        forward = forward or default_forward(self.model_config, cfg.kernels)
        from nanojax.parallel.tp import sharded_forward
        forward, cache_cfg = sharded_forward(self.model_config, forward,
                                             cfg.tensor_parallel_size)
        from nanojax.parallel.multihost import agree, step_broadcast
        broadcast = step_broadcast(forward)
        num_pages, free = cfg.num_pages, None
        if num_pages is None:
            from nanojax.engine.kv_cache import free_device_bytes
            free = free_device_bytes(cfg.memory_utilization)
            free = free if free is None or broadcast is None else agree(free)
            if free is None:  # CPU: enough for a modest batch of full-length requests
                num_pages = max(64, 8 * self.max_model_len // cfg.page_size)
        num_pages = size_cache(cache_cfg, cfg.page_size, self.max_model_len, 1,
                               num_pages=num_pages, memory_bytes=free,
                               kv_itemsize=self.kv_dtype.itemsize).num_pages
        # every default that depends on the device and the cache, resolved once here
        self.config = cfg = cfg.resolve(platform, num_pages * cfg.page_size, self.max_model_len)
        assert cfg.b_dense is not None and cfg.admission is not None  # resolve() sets them
        self.sizing = size_cache(cache_cfg, cfg.page_size, self.max_model_len, cfg.b_dense,
                                 num_pages=num_pages, kv_itemsize=self.kv_dtype.itemsize)
        max_seqs = cfg.max_num_seqs or self.sizing.max_num_seqs
        self.allocator = PageAllocator(self.sizing.num_pages)
        self.scheduler = Scheduler(self.allocator, cfg.page_size, cfg.b_dense, max_seqs,
                                   self.max_model_len, chunk_cuts=forward.chunk_cuts,
                                   admission=cfg.admission, max_prefill_seqs=(
                                       forward.attention.prefill_max_seqs
                                       if forward.attention.prefill_block_q else None))
        step_cache = None
        # one jitted step on one device: loadable next start (a sharded step's executable
        # is not: its devices' order is not checked here)
        if forward.traced and cfg.step_cache and cfg.tensor_parallel_size == 1:
            from nanojax.step_cache import StepCache, describe
            step_cache = StepCache.from_jax_config({
                "model": describe(self.model_config),
                "engine": {k: v for k, v in describe(cfg).items()
                           if k not in HOST_ONLY_FIELDS},
                "forward": describe(forward), "kv_dtype": str(self.kv_dtype)},
                jax.devices()[:1])  # where prepare() puts the parameters
        params = cpu_params(  # with the GGUF's blocks kept (--cpu-weights q4)
            bundle, cfg.kernels, platform.gpu, cfg.tensor_parallel_size)
        self.runner = ModelRunner(self.model_config, params, cfg, forward=forward,
                                  num_pages=self.sizing.num_pages,
                                  max_rows=self.scheduler.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  kv_cache_dtype=self.kv_dtype, broadcast=broadcast,
                                  step_cache=step_cache)
        if cfg.fit_step_shapes and not cfg.constant_batch:
            self.scheduler.step_shapes = tuple(self.runner.token_buckets())
            self.scheduler.prefill_spread = cfg.prefill_spread or 0
        self.prefix_cache: PrefixCache | None = None
        self.offloader: KVOffloader | None = None
        if cfg.enable_prefix_caching:
            self._start_prefix_cache()
        elif cfg.kv_offload_host_bytes or cfg.kv_offload_dir:
            raise NanojaxError("KV offload keeps pages by prefix hash: it needs prefix caching")
        self.eos_ids = tuple(self.tokenizer.eos_token_ids if self.tokenizer
                             else self.model_config.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._in_flight: tuple[ScheduledBatch, object, IterationRecord | None] | None = None
        self._aborted: list[Sequence] = []
        self._failure: BaseException | None = None  # the step that failed, if one did
        self._seed_rng = np.random.default_rng(cfg.seed)
        self._ids = itertools.count()
        self.stats = EngineStats()
        self._grammars: GrammarCompiler | None = None
        # some request had allowed_token_ids or bad_words: steps look for masks
        self._masked = False
        # a client's bad words are tokenized once (each word twice: up to 512 encodes)
        self._bad_words_ids = functools.lru_cache(maxsize=64)(
            lambda words: bad_words_token_ids(self.tokenizer, list(words),
                                              self.model_config.vocab_size))
        # the server's threads check constraints while the engine's thread makes matchers:
        # one compiler (its tokenizer takes a while to build), not one per thread
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler for this model's tokenizer (built on first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer")
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 self.eos_ids)
            return self._grammars

    def use_grammar_tokenizer(self, tokenizer) -> None:
        """Compile structured outputs against `tokenizer`, for a model without one of its
        own (random:<shape> benchmarks): the engine still has no tokenizer, so outputs are
        not detokenized. Its ids must be the model's first ones (ids past its vocabulary
        are never allowed under a grammar); its EOS ends a grammar."""
        if self.tokenizer is not None:
            raise NanojaxError("this model has its own tokenizer")
        if tokenizer.vocab_size > self.model_config.vocab_size:
            raise NanojaxError(f"the tokenizer's {tokenizer.vocab_size} tokens do not fit the "
                               f"model's vocabulary of {self.model_config.vocab_size}")
        with self._grammars_lock:
            self._grammars = GrammarCompiler(tokenizer, self.model_config.vocab_size,
                                             tokenizer.eos_token_ids)

    def _start_prefix_cache(self) -> None:
        from nanojax.engine.prefix_cache import PrefixCache, model_fingerprint
        cfg, axis = self.config, self.runner.forward.kv_page_axis
        fp = model_fingerprint(self.model_config, self.bundle.params, self.runner.kv,
                               cfg.page_size, axis)
        if cfg.kv_offload_host_bytes or cfg.kv_offload_dir:
            from nanojax.engine.kv_offload import KVOffloader
            self.offloader = KVOffloader(self.runner, self.sizing.num_pages, axis, fp,
                                         cfg.kv_offload_host_bytes, cfg.kv_offload_dir,
                                         cfg.kv_offload_disk_bytes, self.allocator)
        self.prefix_cache = PrefixCache(self.allocator, cfg.page_size, fp, self.offloader)
        self.scheduler.prefix_cache = self.prefix_cache

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        self._check_alive()
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass prompt token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.check_prompt(ids, params)
        if params.seed is None:  # a fixed seed per request keeps its samples batch-independent
            params = dataclasses.replace(params, seed=int(self._seed_rng.integers(2**31)))
        seq = Sequence(request_id, ids, params, self.eos_ids)
        if params.structured_outputs is not None:
            seq.matcher = self._matcher(params)
        if params.prompt_logprobs is not None and self.runner.broadcast is not None:
            raise RequestError("prompt_logprobs are not supported across processes yet")
        if params.allowed_token_ids is not None:
            if self.runner.broadcast is not None:  # (masks are not sent to followers)
                raise RequestError("allowed_token_ids are not supported across processes yet")
            seq.allowed_mask = token_mask(params.allowed_token_ids,
                                          self.model_config.vocab_size)
            self._masked = True
        if params.bad_words:
            if self.runner.broadcast is not None:
                raise RequestError("bad_words are not supported across processes yet")
            if self.tokenizer is None:
                raise RequestError("bad_words need the model's tokenizer")
            try:
                seq.bad_words_ids = self._bad_words_ids(tuple(params.bad_words))
            except ValueError as e:
                raise RequestError(str(e)) from None
            self._masked = True
        self.requests[request_id] = seq
        # disk pages of its prefix to host memory, meanwhile (an offloader has a prefix cache)
        if self.offloader is not None and self.prefix_cache is not None:
            usable = (len(ids) - 1) // self.config.page_size
            self.offloader.prefetch(self.prefix_cache.hashes(seq, usable))
        if self.tokenizer is not None and _text_while_running(params):
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer,
                                                             params.skip_special_tokens)
        self.scheduler.add(seq)
        return request_id

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        try:
            params.check_vocab(vocab)
        except SamplingError as e:
            raise RequestError(str(e)) from None
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} "
                               f"tokens, but the prompt has {len(ids)} tokens and max_tokens "
                               f"is {params.max_tokens}")

    def _matcher(self, params: SamplingParams):
        if self.runner.broadcast is not None:
            raise RequestError("structured outputs are not supported across processes yet")
        # called with structured_outputs set, which __post_init__ made the dataclass
        assert isinstance(params.structured_outputs, StructuredOutputsParams)
        try:
            return self.grammars.matcher(params.structured_outputs)
        except StructuredOutputError as e:
            raise RequestError(f"structured_outputs: {e}") from None

    def abort_request(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        seq.finish("abort")
        self.scheduler.remove(seq)
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return any(not s.is_finished for s in self.requests.values()) or bool(self._aborted)

    @property
    def is_idle(self) -> bool:
        """No request left and no step whose results are still to be read."""
        return not self.has_unfinished() and self._in_flight is None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def kv_usage(self) -> float:
        """Pages sequences reference; cached pages nobody references count as free."""
        a = self.allocator
        return a.num_used / a.num_pages

    # ---- one iteration -------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._failure is not None:
            e = self._failure
            raise EngineDeadError(f"the engine stopped after a failed step "
                                  f"({type(e).__name__}: {e}); start a new one") from e

    def step(self) -> list[RequestOutput]:
        """One iteration. If it raises, the engine is dead: sequences may hold tokens that
        will never be read and pages of a step that never ran, so every later call raises
        EngineDeadError with the first error rather than scheduling on that state."""
        self._check_alive()
        try:
            return self._step()
        except BaseException as e:
            self._failure = e
            raise

    def _step(self) -> list[RequestOutput]:
        start, wait_before = time.perf_counter(), self.stats.wait_s
        # the step in flight: its rows hold the newest tokens of the decodes in it
        prev = self._in_flight[0] if self._in_flight is not None else None
        with TraceAnnotation("nanojax.schedule"):  # phases, for the engine's timelines
            batch = self.scheduler.schedule(prev)
        schedule_s = time.perf_counter() - start
        if not batch and self._in_flight is None:  # nothing to run but tier pages on the
            self.scheduler.wait_for_loads(0.01)    # way: wait for them, not spin
        t_launch = time.perf_counter()
        loads = self.scheduler.take_loads()
        if loads:  # offloaded pages into fresh ones, ordered before this step
            assert self.offloader is not None  # the loads come from it
            self.offloader.load(loads)
        constrained = self._constrained_rows(batch) if batch else []
        with TraceAnnotation("nanojax.launch"):
            launched = ((batch, self.runner.launch(batch, masked=bool(constrained)),
                         self._record(batch)) if batch else None)
        if launched and launched[2] is not None:
            launched[2].launch_s = time.perf_counter() - t_launch
            launched[2].inputs_s = self.runner.last_inputs_s
        if launched:
            self.stats.steps += 1
            self.stats.scheduled_tokens += batch.num_tokens
            self.stats.prompt_tokens += sum(e.num_tokens
                                            for e in batch.entries[batch.num_decodes:])
        results = [self._finish_output(s) for s in self._aborted]
        self._aborted = []
        try:
            if self.config.async_scheduling and self._in_flight is not None:
                with TraceAnnotation("nanojax.process"):
                    results += self._process(*self._in_flight)
        finally:  # the matchers have this step's newest tokens: its masks can be filled
            if constrained:
                assert launched is not None and isinstance(launched[1], MaskedStep)
                launched[1].complete(self._bitmask_fn(batch, constrained))
        if self.config.async_scheduling:
            self._in_flight = launched
        elif launched:
            results += self._process(*launched)
        if self.offloader is not None:
            # saved pages are held until their copy out is dispatched, in whole chunks
            # (a gather's dispatch costs the same for 5 pages as for 128); with nothing
            # launched or left to run, the rest goes now (kv_offload.py's docstring)
            self.offloader.flush(force=launched is None or not self.requests)
        waited = self.stats.wait_s - wait_before
        host = time.perf_counter() - start - waited
        self.stats.host_s += host
        if launched and launched[2] is not None:
            rec = launched[2]
            rec.host_s, rec.wait_s = host, waited
            rec.schedule_s, rec.process_s = schedule_s, host - schedule_s - rec.launch_s
        return results

    def _constrained_rows(self, batch: ScheduledBatch) -> list[int]:
        """The rows that sample under a grammar, allowed_token_ids or bad_words (none
        before the first such request: not even a scan)."""
        if self._grammars is None and not self._masked:
            return []
        return [r for r, e in enumerate(batch.entries) if e.samples and (
            e.seq.matcher is not None or e.seq.allowed_mask is not None
            or e.seq.bad_words_ids)]

    def _bitmask_fn(self, batch: ScheduledBatch, rows: list[int]):
        """The masked step's bitmask_fn, its matchers taken now (each has its row's newest
        token: the step before was processed); the fill may run on the dispatch thread,
        and nothing advances these matchers until this step's tokens are read. A request
        that finished since it was scheduled (its matcher released) leaves its row free:
        this step's token of it is dropped. Bad words' bans are taken now, from each
        row's output so far (which this step's token follows)."""
        seqs, vocab = [batch.entries[r].seq for r in rows], self.model_config.vocab_size
        matchers = [(s.matcher, r) for s, r in zip(seqs, rows) if s.matcher is not None]
        fixed = [(s.allowed_mask, r) for s, r in zip(seqs, rows) if s.allowed_mask is not None]
        bans = [(without_tokens(b, vocab), r) for s, r in zip(seqs, rows) if s.bad_words_ids
                and (b := banned_tokens(s.bad_words_ids, s.output_ids))]
        if not matchers and not fixed and not bans:  # bad words, none banned now
            return lambda num_rows: None
        if not matchers:  # (no tokenizer needed)
            return lambda num_rows: fixed_bitmask(fixed, num_rows, vocab, bans)
        grammars = self.grammars
        return lambda num_rows: grammars.bitmask(matchers, num_rows, fixed, bans)

    def _record(self, batch: ScheduledBatch) -> IterationRecord | None:
        if self.stats.trace is None:
            return None
        s = self.scheduler
        rec = IterationRecord(batch.num_tokens, batch.num_decodes, len(s.waiting),
                              len(s.running), s.num_preemptions)
        self.stats.trace.append(rec)
        return rec

    def _process(self, batch: ScheduledBatch, out, record: IterationRecord | None = None
                 ) -> list[RequestOutput]:
        t = time.perf_counter()
        with TraceAnnotation("nanojax.to_host"):
            tokens, chosen, top_ids, top_lp, scores = out.to_host()
        done = time.perf_counter()
        self.stats.wait_s += done - t
        if record is not None:
            record.done_t = done
        if scores is not None:
            self._prompt_logprobs(batch, *scores)
        results = []
        ids = tokens.tolist()  # Python ints once, not a numpy scalar per row
        generated = 0
        for row, e in enumerate(batch.entries):
            seq = e.seq
            if not e.samples or seq.status is Status.FINISHED:
                continue
            seq.pending -= 1
            tok = ids[row]
            seq.output_ids.append(tok)
            generated += 1
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                seq.logprobs.append({"token_id": tok, "logprob": float(chosen[row]),
                                     "top": [(int(i), float(v)) for i, v in
                                             zip(top_ids[row][:k], top_lp[row][:k])]})
            try:  # detokenizing or stop matching fails this request only
                self._check_finish(seq, tok)
            except Exception as exc:
                seq.finish("error", f"{type(exc).__name__}: {exc}")
            finished = seq.status is Status.FINISHED
            if finished or seq.params.output_kind != "final_only":
                results.append(self._output(seq))
            if finished:
                # its last pages, and any dropped before (an offloader has a prefix cache)
                if self.offloader is not None and self.prefix_cache is not None:
                    self.prefix_cache.register(seq)
                    n = seq.num_cached_pages
                    self.offloader.save(seq.pages[:n], seq.block_hashes[:n])
                self.scheduler.remove(seq)
                self._retire(seq)
        self.stats.generation_tokens += generated
        return results

    @staticmethod
    def _prompt_logprobs(batch: ScheduledBatch, logprob, rank, top_ids, top_lp) -> None:
        """A step's scored prompt tokens into their requests, in the order the runner
        laid them out (ModelRunner._score_inputs): prefill rows in order, each chunk's
        scored positions; a position's logits score the token after it."""
        k = 0
        for e in batch.entries[batch.num_decodes:]:
            seq = e.seq
            if seq.prompt_logprobs is None:
                continue
            n = seq.params.prompt_logprobs
            for j in seq.scored_positions(e.start, e.num_tokens):
                seq.prompt_logprobs[j + 1] = {
                    "token_id": seq.prompt_ids[j + 1], "logprob": float(logprob[k]),
                    "rank": int(rank[k]),
                    "top": list(zip(top_ids[k][:n].tolist(), top_lp[k][:n].tolist()))}
                k += 1

    def _check_finish(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        detok = self._detok.get(seq.request_id)
        before = seq.text
        if detok is not None:
            detok.push([tok])
            seq.text = detok.text
        n = len(seq.output_ids)
        if seq.matcher is not None and not seq.matcher.consume_token(tok):
            return seq.finish("error", f"grammar: {seq.matcher.get_error()[:300]}")
        if n >= p.min_tokens:
            stop_id = tok in (p.stop_token_ids or ())
            if stop_id or (tok in seq.eos_ids and not p.ignore_eos):
                if not p.include_stop_str_in_output:  # the stop token's text left out
                    seq.text, seq.text_ids_end = before, n - 1  # (vLLM's, special or not)
                return seq.finish("stop", tok if stop_id else None)
            if p.stop and detok is not None:
                window = max(len(s) for s in p.stop) + 16
                start = max(0, len(seq.text) - window)
                hits = [(seq.text.find(s, start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    seq.text = seq.text[:i + len(s) if p.include_stop_str_in_output else i]
                    return seq.finish("stop", s)
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            return seq.finish("stop")
        if n >= p.max_tokens or seq.num_known >= self.max_model_len:
            seq.finish("length")

    def _retire(self, seq: Sequence) -> None:
        self.stats.finished[seq.finish_reason] = self.stats.finished.get(seq.finish_reason, 0) + 1
        seq.matcher = None  # its parser state freed now, whoever still holds the Sequence
        self.runner.page_tables.release(seq)
        self._detok.pop(seq.request_id, None)
        self.requests.pop(seq.request_id, None)

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        self._retire(seq)
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        if self.tokenizer is not None and not _text_while_running(seq.params):
            seq.text = self.tokenizer.decode(  # once, at the end
                seq.output_ids[:seq.text_ids_end],
                skip_special_tokens=seq.params.skip_special_tokens)
        text = seq.text
        if not seq.is_finished and seq.params.stop:  # hold back a possible stop prefix
            text = text[:max(seq.sent_text_len, len(text) - max(map(len, seq.params.stop)) + 1)]
        delta_text = text[seq.sent_text_len:]
        delta_ids = seq.output_ids[seq.sent_tokens:]
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        if seq.params.output_kind == "delta":  # no copy of what was sent before
            comp = CompletionOutput(0, delta_text, delta_ids, seq.finish_reason,
                                    seq.stop_reason,
                                    logprobs[seq.sent_tokens:] if logprobs is not None else None)
        else:
            comp = CompletionOutput(0, text, list(seq.output_ids), seq.finish_reason,
                                    seq.stop_reason, list(logprobs) if logprobs is not None else None)
        seq.sent_text_len, seq.sent_tokens = len(text), len(seq.output_ids)
        ttft = seq.first_token_time - seq.arrival if seq.first_token_time else None
        return RequestOutput(seq.request_id, None, seq.prompt_ids, [comp], seq.is_finished,
                             ttft, seq.num_preemptions, delta_text, delta_ids,
                             seq.prompt_logprobs)

    # ---- offline helper ------------------------------------------------------------------
    def run_to_completion(self, progress=None, max_steps: int | None = None,
                          done: dict | None = None, stop: threading.Event | None = None
                          ) -> dict[str, RequestOutput]:
        """Steps until idle (or max_steps steps, or stop is set: a benchmark's time limit);
        finished outputs added to done."""
        done = {} if done is None else done
        with frozen_startup_objects(self.config.gc_freeze):
            while not self.is_idle and (max_steps is None or max_steps > 0) and not (
                    stop is not None and stop.is_set()):
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
                        if progress is not None:
                            progress.update(1)
                max_steps = None if max_steps is None else max_steps - 1
        return done


def _text_while_running(params: SamplingParams) -> bool:
    """Whether a request's text is needed before it ends (stop strings, streamed or
    cumulative outputs); a final-only one is detokenized once, off the per-token path."""
    return bool(params.stop) or params.output_kind != "final_only"
