"""Model runner: turns a ScheduledBatch into device arrays and launches one jitted step.

The step is: pick input tokens (from the host, or from the previous step's samples still on
the device), run the model's forward over the packed tokens, sample one token per sampling
row. Shapes are bucketed (tokens, rows, pages per row) so steady state never recompiles.
The forward is a parameter: the plain one below, or a nano-batch pipeline executor.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import threading
import time
import types
from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import EngineConfig, ModelConfig
from nanojax.errors import ConfigError
from nanojax.engine.forward import Forward, default_forward
from nanojax.engine.kv_cache import device_memory, pages_left_at_peak
from nanojax.engine.page_tables import PageTables
from nanojax.engine.sampling import (Penalties, any_logprobs, any_sampling, penalty_inputs,
                                     sample, token_logprobs, with_pending)
from nanojax.engine.scheduler import MAX_SCORED_TOKENS, ScheduledBatch
from nanojax.engine.structured import GrammarMasks, mask_sizes
from nanojax.layers.attention import PagedMetadata, prefill_metadata

if TYPE_CHECKING:
    from nanojax.engine.sequence import Sequence
    from nanojax.step_cache import CachedJit


def bucket(n: int, minimum: int, maximum: int | None = None, step: int | None = None) -> int:
    """n rounded up to a power of two (at least minimum), or above step to a multiple of
    step; capped at maximum where n fits under it."""
    b = max(minimum, 1 << max(0, n - 1).bit_length())
    if step is not None and b > step:
        b = max(minimum, -(-n // step) * step)
    return min(b, maximum) if maximum is not None and n <= maximum else b


def engine_rows(max_num_seqs: int, min_row_bucket: int, one_shape: bool) -> int:
    """The row count (sequences: page table, sampling, LM head) of an engine allowed
    max_num_seqs sequences: every step's with one row shape (fixed shapes, the GPU
    default; the B_dense step may also run 5/8 of it: ModelRunner.row_shapes), the largest
    one's otherwise. Where the row count varies it is padded to a
    power of two (few shapes); one row count is only rounded to 64 (max_num_seqs 1,152
    runs 1,152 rows, not 2,048, each padding row costing its logits over the vocabulary
    and its sampling). The step benchmark pads its synthetic batches to it."""
    if one_shape:
        return max(min_row_bucket, -(-max_num_seqs // 64) * 64)
    return bucket(max_num_seqs, min_row_bucket)


def _padding_batch(num_tokens: int) -> ScheduledBatch:
    """A stand-in for a ScheduledBatch of num_tokens padding tokens and no rows (warmup's:
    it compiles and runs a step shape, writing nothing to the cache)."""
    return cast(ScheduledBatch, types.SimpleNamespace(entries=[], num_decodes=0,
                                                      num_tokens=num_tokens))


def _step_key(host_tokens, meta, logit_idx) -> tuple:
    """The host arrays' shapes determine the step's (params, cache: the runner's)."""
    return tuple(np.shape(x) for x in jax.tree_util.tree_leaves((host_tokens, meta,
                                                                  logit_idx)))


def _input_tokens(prev_tokens, host_tokens, token_src):
    """Each token from the host, or the previous step's sample still on the device."""
    return jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], host_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """One step's inputs as the host builds them (numpy; placed on the device by the
    runner). Token arrays are [T] (the padded batch), row arrays [R] (rows follow the
    batch's entries; the sampler reads them)."""
    host_tokens: jax.Array    # [T] int32: each token's id where the host knows it
    token_src: jax.Array      # [T] int32: else the previous step's row it was sampled in
    meta: PagedMetadata       # where each token goes in the paged cache, what it attends
    logit_idx: jax.Array      # [R] int32: the token whose logits each row samples from
    temperature: jax.Array    # [R] f32 (0: greedy)
    top_p: jax.Array          # [R] f32
    top_k: jax.Array          # [R] int32 (-1: off)
    min_p: jax.Array          # [R] f32 (0: off)
    seeds: jax.Array          # [R] uint32
    steps: jax.Array          # [R] int32: tokens the row has generated (its PRNG step)
    penalties: Penalties | None  # None when no row asks for penalties or logit_bias
    # [R] bool: picks the sampler's variant on the host; never sent to the device
    wants_logprobs: np.ndarray
    # prompt_logprobs: the tokens whose logits score the prompt token after them [S], and
    # those tokens [S] (padding: token 0 scoring id 0); None in a step that scores none.
    # The forward's logit rows are logit_idx's, then score_idx's.
    score_idx: jax.Array | None = None
    score_ids: jax.Array | None = None


@dataclasses.dataclass
class StepOutput:
    """Device arrays of one launched step; rows follow the batch's entries. scores: the
    scored prompt tokens' (logprob [S], rank [S], top ids [S, K], top logprobs [S, K]) in
    score_idx's order, or None."""
    tokens: jax.Array
    chosen_logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    scores: tuple | None = None

    def to_host(self):
        """(tokens, chosen logprob, top ids, top logprobs, scores or None) as numpy."""
        out = (self.tokens, self.chosen_logprob, self.top_ids, self.top_logprobs)
        # across processes the outputs are replicated global arrays: read our own copy
        return jax.device_get(tuple(x if x.is_fully_addressable else x.addressable_data(0)
                                    for x in out) + (self.scores,))


class DispatchedStep:
    """A step handed to the runner's dispatch thread: its StepOutput once dispatched."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def result(self) -> StepOutput:
        return self._future.result()

    @property
    def tokens(self) -> jax.Array:
        return self.result().tokens

    def to_host(self):
        return self.result().to_host()


class MaskedStep:
    """A step with grammar-constrained rows: its forward is dispatched at launch, its
    sampler by complete(bitmask_fn) once the engine has advanced the rows' matchers (it
    reads the step before first). With async dispatch the mask is filled on the dispatch
    thread, so the engine thread goes on to the next iteration's schedule meanwhile."""

    def __init__(self, runner: "ModelRunner", inputs: StepInputs, forward):
        self._runner, self._inputs, self._forward = runner, inputs, forward
        self._out: StepOutput | concurrent.futures.Future | None = None

    def complete(self, bitmask_fn) -> None:
        """bitmask_fn(num_rows) -> the step's GrammarMasks (GrammarCompiler.bitmask),
        called after the forward is dispatched, on the dispatch thread where there is one."""
        self._out = self._runner._complete(self._inputs, self._forward, bitmask_fn)

    def result(self) -> StepOutput:
        if self._out is None:
            raise RuntimeError("a masked step read before complete() dispatched its sampler")
        return self._out.result() if isinstance(self._out, concurrent.futures.Future) else self._out

    @property
    def tokens(self) -> jax.Array:
        return self.result().tokens

    def to_host(self):
        return self.result().to_host()


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, config: EngineConfig, *,
                 forward: Forward | None = None, num_pages: int, max_rows: int,
                 max_model_len: int, kv_cache_dtype=None, broadcast=None, step_cache=None):
        """config: the engine's, resolved (EngineConfig.resolve): the dense batch, the
        shape buckets, fixed shapes, compile threads, async dispatch. num_pages: the KV
        cache's; max_rows: most sequences a step holds; max_model_len: the longest one.
        step_cache: a nanojax.step_cache.StepCache the traced step's executables are
        loaded from and stored to (skips tracing on a warm start); None: jit only."""
        self.config = config
        assert config.b_dense is not None and config.min_row_bucket is not None  # resolved
        self.cfg = cfg
        self.page_size = config.page_size
        self.b_dense = config.b_dense
        self.constant_batch = config.constant_batch
        self.max_pages_per_seq = -(-max_model_len // config.page_size)
        self.page_tables = PageTables(self.max_pages_per_seq)  # (engine releases rows)
        # one row count and page-table width: only the token count varies, so warmup()
        # can compile every shape the engine will launch (a serving start, not mid-run)
        self.fixed_shapes = bool(config.fixed_shapes)
        one_shape = self.fixed_shapes or self.constant_batch
        self.max_rows = engine_rows(max_rows, config.min_row_bucket, one_shape)
        # fixed shapes: the B_dense step also at 5/8 of the rows, where that is fewer: a
        # steady state of half decodes and half prefill has a little over half (~1,030
        # of 2,048 at 128/128 and 1000/1000), the KV-bound long rows fewer still
        small = engine_rows(-(-self.max_rows * 5 // 8), config.min_row_bucket, True)
        self._full_step_rows = sorted({self.max_rows} | (
            {small} if self.fixed_shapes and not self.constant_batch
            and config.full_step_row_shapes == 2 else set()))
        forward = forward or default_forward(cfg)
        self.forward = forward
        self.params = forward.prepare(params)
        self.kv = forward.init_kv(num_pages, self.page_size, kv_cache_dtype)  # None: the model's
        self.num_pages = num_pages
        self._traces = 0
        self._trace_lock = threading.Lock()
        self.num_sampler_compiles = 0
        # the device's memory after each phase of the warm-up (None: not run, or CPU)
        self.warmup_memory: dict | None = None
        self.last_inputs_s = 0.0
        self.mask_s = 0.0   # filling grammar masks, summed (MaskedStep.complete)
        self.num_masks = 0
        self._lock = threading.Lock()
        # across processes every step's inputs are global arrays: plain jit there
        self.step_cache = step_cache if broadcast is None else None
        # the dispatch thread (async_dispatch): one step dispatched at a time, in order
        self._dispatcher = (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="nanojax-dispatch")
            if config.async_dispatch and broadcast is None else None)
        self._dispatching: concurrent.futures.Future | None = None
        # Two executables a step: the forward (tokens in, logits and the cache out) and the
        # sampler, whose variants (greedy or sampling: `sample`'s static flag, chosen on
        # the host) are small to compile; neither holds a device-side conditional
        self._cached_step: CachedJit | None = None  # the step's CachedJit, with a step cache
        self._forward = self._make_forward(forward)
        self._sample = jax.jit(self._make_sampler(forward),
                               static_argnames=("sampling", "logprobs"))
        self._score = jax.jit(self._make_scorer(forward))
        # several processes (parallel/multihost.py): process 0 sends each step's inputs
        self.broadcast = broadcast
        self._prev = jnp.zeros((self.max_rows,), jnp.int32)
        if broadcast is not None:
            self._prev = broadcast.place(np.zeros((self.max_rows,), np.int32))

    @property
    def num_loaded(self) -> int:
        """Step shapes loaded from the step cache (not traced) so far."""
        return self.step_cache.loaded if self.step_cache is not None else 0

    @property
    def num_compiles(self) -> int:
        """Step shapes compiled so far (traced: a persistent-cache hit counts too); a
        forward that dispatches its own layers counts its layer's."""
        return self._traces + self.forward.num_traces

    def _make_forward(self, forward):
        options = forward.compiler_options or None
        if not forward.traced:  # it dispatches its layers: jit the rest
            input_tokens = jax.jit(_input_tokens, compiler_options=options)

            def layerwise(params, kv, prev_tokens, host_tokens, token_src, meta, logit_idx):
                tokens = input_tokens(prev_tokens, host_tokens, token_src)
                meta = jax.device_put(meta)  # once, not once per layer call
                logits, kv = forward(params, tokens, kv, meta, logit_idx)
                return kv, logits

            return layerwise

        def step(params, kv, prev_tokens, host_tokens, token_src, meta, logit_idx):
            with self._trace_lock:  # warm-up may trace shapes in several threads
                self._traces += 1  # runs once per trace, i.e. per compilation
            tokens = _input_tokens(prev_tokens, host_tokens, token_src)
            logits, kv = forward(params, tokens, kv, meta, logit_idx)
            return kv, logits

        jitted = jax.jit(step, donate_argnums=(1,), compiler_options=options)
        if self.step_cache is None:
            return jitted
        from nanojax.step_cache import CachedJit
        cached = self._cached_step = CachedJit(jitted, self.step_cache)

        def from_cache(params, kv, prev_tokens, host_tokens, token_src, meta, logit_idx):
            return cached(_step_key(host_tokens, meta, logit_idx), params, kv, prev_tokens,
                          host_tokens, token_src, meta, logit_idx)

        return from_cache

    def _make_sampler(self, forward):
        max_rows = self.max_rows
        # vocab-sharded logits: the top logprobs are read shard by shard (parallel/tp.py)
        top_logprobs = forward.top_logprobs

        def sampler(logits, prev_tokens, host_tokens, token_src, logit_idx, temperature,
                    top_p, top_k, min_p, seeds, steps, penalties, bitmask, sampling,
                    logprobs):
            self.num_sampler_compiles += 1
            if penalties is not None:  # a decode's input may be a sample the host lacks
                tokens = _input_tokens(prev_tokens, host_tokens, token_src)
                penalties = with_pending(penalties, tokens[logit_idx],
                                         token_src[logit_idx] >= 0)
            out = sample(logits, temperature, top_p, top_k, seeds, steps, penalties,
                         top_logprobs, sampling=sampling, logprobs=logprobs,
                         bitmask=bitmask, min_p=min_p)
            pad = max_rows - logits.shape[0]
            return [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in out]

        return sampler

    @staticmethod
    def _make_scorer(forward):
        top_logprobs = forward.top_logprobs

        def scorer(logits, score_ids):
            """The step's logits split: the sampling rows', and the scored prompt tokens'
            log-probabilities from the rows after them."""
            rows = logits.shape[0] - score_ids.shape[0]
            return logits[:rows], token_logprobs(logits[rows:], score_ids, top_logprobs,
                                                 rank=True)

        return scorer

    def shapes_for(self, batch: ScheduledBatch, rows: int | None = None
                   ) -> tuple[int, int, int]:
        """(tokens, rows, pages per row) of the step that runs batch; rows: of the fixed
        shapes' row counts (row_shapes), the one to use (warmup's all-padding batches)."""
        if self.constant_batch and self.max_pages_per_seq:  # one shape: one compile
            return self.b_dense, self.max_rows, bucket(self.max_pages_per_seq, 4)
        t = self.step_tokens(batch.num_tokens)
        if self.fixed_shapes:
            if rows is None:
                rows = next((r for r in self.row_shapes(t) if r >= len(batch.entries)), None)
                if rows is None:
                    raise ValueError(f"a batch of {len(batch.entries)} sequences is more than "
                                     f"the {self.max_rows} rows its step shapes have")
            return t, rows, bucket(self.max_pages_per_seq, 4)
        assert self.config.min_row_bucket is not None  # resolved (EngineConfig.resolve)
        r = bucket(len(batch.entries), self.config.min_row_bucket, self.max_rows)
        if self.max_pages_per_seq and self.forward.attention.width_free:
            return t, r, bucket(self.max_pages_per_seq, 4)  # one width: fewer compiles
        p = bucket(max(len(e.seq.pages) for e in batch.entries), 4)
        return t, r, p

    def row_shapes(self, num_tokens: int) -> list[int]:
        """With fixed shapes, the row counts a step of num_tokens (a bucket) is compiled
        for, ascending: the B_dense step's (EngineConfig.full_step_row_shapes), else one."""
        return self._full_step_rows if num_tokens == self.b_dense else [self.max_rows]

    def token_buckets(self) -> list[int]:
        """The token counts a step can be launched with."""
        if self.constant_batch:
            return [self.b_dense]
        out = [self._token_bucket(1)]
        while out[-1] < self.b_dense:
            out.append(self._token_bucket(out[-1] + 1))
        return out

    def step_tokens(self, n: int) -> int:
        """The token count a step of n tokens is launched with (padded to)."""
        return self.b_dense if self.constant_batch else self._token_bucket(n)

    def _token_bucket(self, n: int) -> int:
        assert self.config.min_token_bucket is not None  # resolved (EngineConfig.resolve)
        return bucket(n, self.config.min_token_bucket, self.b_dense,
                      self.config.token_bucket_step)

    def warmup(self, progress: bool = False, threads: int | None = None,
               masked: bool = True) -> int:
        """_warmup, with the device running out of memory in it said as a ConfigError: the
        KV cache took what the largest step's buffers need (fp8.md §91's H100)."""
        try:
            return self._warmup(progress, threads, masked)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # one device's share (a tensor-parallel cache is sharded over its devices)
            kv_gb = sum(x.addressable_shards[0].data.nbytes
                        for x in jax.tree.leaves(self.kv)) / 1e9
            raise ConfigError(
                f"the device ran out of memory warming up the step shapes "
                f"({str(e).splitlines()[0][:160]}): the KV cache's {kv_gb:.1f} GB leave too "
                f"little for the largest step ({self.b_dense} tokens, {self.max_rows} rows) "
                f"and its sampler. Give fewer --num-pages, or a smaller --b-dense or "
                f"--max-num-seqs") from e

    def _warmup(self, progress: bool = False, threads: int | None = None,
                masked: bool = True) -> int:
        """With fixed_shapes: compiles the step for every token bucket by launching an
        all-padding batch of each size (nothing is written to the cache: padding tokens
        have no slot). progress: a bar, shape k of n, on stderr. threads > 1 (with a step
        cache; None: compile_threads): the shapes are loaded or compiled that many at a
        time first, the B_dense one alone before the others (XLA autotunes its GEMMs on
        the device: an idle GPU for the shape that carries the throughput). Then the
        sampler's variants, with masked the grammar-masked ones too (structured outputs:
        otherwise compiled by the first constrained step, mid-run; one process only, as
        structured outputs are). Returns how many shapes were compiled (traced: a
        persistent-cache hit counts, but loads in a moment)."""
        if not self.fixed_shapes:
            raise ValueError("warmup() needs fixed_shapes (one row count and page width)")
        from tqdm.auto import tqdm
        before = self.num_compiles
        # (tokens, rows) of every step shape, the B_dense one with the most rows last
        shapes = [(t, r) for t in self.token_buckets() for r in self.row_shapes(t)]
        bar = tqdm(total=len(shapes), desc="compiling step shapes", unit="shape",
                   disable=not progress, file=sys.stderr)
        threads = self.config.compile_threads if threads is None else threads
        assert threads is not None  # compile_threads: resolved (EngineConfig.resolve)
        parallel = threads > 1 and self._cached_step is not None and len(shapes) > 2
        if parallel:
            self._prepare_step(*shapes[-1])
            bar.update()
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                for done in concurrent.futures.as_completed(
                        [pool.submit(self._prepare_step, *s) for s in shapes[:-1]]):
                    done.result()
                    bar.update()
        for t, r in shapes:  # with parallel: prepared executables, run once each
            jax.block_until_ready(self.launch(_padding_batch(t), rows=r).tokens)
            bar.update(0 if parallel else 1)
        bar.close()
        after_steps = device_memory()
        self._warm_samplers(_padding_batch(self.token_buckets()[-1]),
                            masked and self.broadcast is None)
        # the peak is a high-water mark: these show which phase raised it, not a later
        # phase's own peak below it (the step shapes' runs include the greedy sampler)
        if after_steps is not None:
            after = device_memory()
            self.warmup_memory = {"after_step_shapes": after_steps, "after_samplers": after}
            if after is not None and {"peak_bytes_in_use", "bytes_limit"} <= after.keys():
                # one device's bytes a page (a share of each layer's pool under TP)
                page_bytes = sum(x.addressable_shards[0].data.nbytes
                                 for x in jax.tree_util.tree_leaves(self.kv)) // self.num_pages
                self.warmup_memory["pages_left_at_peak"] = pages_left_at_peak(
                    after, page_bytes, self.config.memory_utilization)
        return self.num_compiles - before

    def _warm_samplers(self, empty, masked: bool) -> None:
        """The sampler's other variants (one row shape): a padding row at temperature 1
        and / or asking for logprobs, each also under all-allowing grammar masks of each
        size when masked (the mask changes the program, not its values); it samples a
        token nobody reads. The unmasked greedy one ran with the step shapes. Each of
        the step's row counts has its own."""
        for rows in self.row_shapes(empty.num_tokens):
            self._warm_sampler_rows(empty, rows, masked)

    def _warm_sampler_rows(self, empty, rows: int, masked: bool) -> None:
        num_rows = len(self._host_inputs(empty, *self.shapes_for(empty, rows)).temperature)
        variants: list[tuple[float, bool, int | None]] = [
            (t, lp, None) for t, lp in ((1.0, False), (0.0, True), (1.0, True))]
        if masked:  # every size a step's masks come in (structured.mask_sizes)
            variants += [(t, lp, n) for t in (0.0, 1.0) for lp in (False, True)
                         for n in mask_sizes(num_rows)]
        words = -(-self.cfg.vocab_size // 32)  # the packed mask's width
        self.wait_dispatched()
        for temperature, logprobs, mask_size in variants:
            inputs = self._host_inputs(empty, *self.shapes_for(empty, rows))
            inputs.temperature[0], inputs.wants_logprobs[0] = temperature, logprobs
            if self.broadcast is not None:
                self.broadcast.send(inputs)
            allow_all = None if mask_size is None else (
                lambda rows, n=mask_size: GrammarMasks(np.full((n, words), -1, np.int32),
                                                       np.full(n, rows, np.int32)))
            jax.block_until_ready(self._run(inputs, allow_all).tokens)

    def with_kv(self, fn):
        """fn(cache) dispatched against the current cache (e.g. a copy of pages out),
        after every step launched so far."""
        self.wait_dispatched()
        with self._lock:
            return fn(self.kv)

    def update_kv(self, fn) -> None:
        """cache = fn(cache), ordered between the steps (e.g. pages copied in): after
        every step launched so far, before the next."""
        self.wait_dispatched()
        with self._lock:
            self.kv = fn(self.kv)

    def launch(self, batch: ScheduledBatch, masked: bool = False, rows: int | None = None
               ) -> "StepOutput | DispatchedStep | MaskedStep":
        """Builds the step's inputs on the host and dispatches it (with async_dispatch
        from the dispatch thread, whose StepOutput comes when it is dispatched); does not
        block. masked (some row under a grammar): only the forward is dispatched; the
        returned MaskedStep's complete() dispatches the sampler with the rows' masks.
        rows: the fixed shapes' row count to run at (shapes_for)."""
        t = time.perf_counter()
        with jax.profiler.TraceAnnotation("nanojax.inputs"):
            inputs = self._host_inputs(batch, *self.shapes_for(batch, rows))
        self.last_inputs_s = time.perf_counter() - t  # CPU work, for the engine's records
        if self.broadcast is not None:
            if masked:  # followers would need the mask sent after it
                raise NotImplementedError("structured outputs across processes")
            self.broadcast.send(inputs)
        if masked:
            return MaskedStep(self, inputs, self._submit(self._dispatch_forward, inputs))
        out = self._submit(self._run, inputs)
        return DispatchedStep(out) if isinstance(out, concurrent.futures.Future) else out

    def _submit(self, fn, *args):
        """fn(*args) on the dispatch thread (a Future, in launch order), or here."""
        if self._dispatcher is None:
            return fn(*args)
        self._dispatching = self._dispatcher.submit(fn, *args)
        return self._dispatching

    def _complete(self, inputs: StepInputs, forward, bitmask_fn):
        def masked_sample():
            fwd = forward.result() if isinstance(forward, concurrent.futures.Future) else forward
            t = time.perf_counter()
            with jax.profiler.TraceAnnotation("nanojax.grammar_mask"):
                bitmask = bitmask_fn(len(inputs.temperature))
            self.mask_s += time.perf_counter() - t
            self.num_masks += 1
            return self._dispatch_sample(inputs, fwd, bitmask)
        return self._submit(masked_sample)

    def wait_dispatched(self) -> None:
        """Returns once every launched step is dispatched (async_dispatch)."""
        if self._dispatching is not None:
            self._dispatching.result()
            self._dispatching = None

    def follow(self) -> int:
        """Processes other than 0: run process 0's steps until it stops; returns how many."""
        empty = types.SimpleNamespace(entries=[], num_decodes=0, num_tokens=0)
        plain = self._host_inputs(empty, 16, 4, 4)  # no row processes its logits
        with_penalties = dataclasses.replace(
            # host arrays for the jax.Array leaves (a pytree's leaves have one type to mypy)
            plain, penalties=Penalties(*[np.zeros(1)] * len(Penalties._fields)))  # type: ignore[arg-type]
        treedefs = {len(jax.tree_util.tree_leaves(t)): jax.tree_util.tree_structure(t)
                    for t in (plain, with_penalties)}
        n = 0
        while (inputs := self.broadcast.receive(treedefs)) is not None:
            self._run(inputs)
            n += 1
        return n

    def stop_followers(self) -> None:
        if self.broadcast is not None:
            self.broadcast.stop()

    def _prepare_step(self, num_tokens: int, rows: int) -> None:
        """Loads or compiles the step for an all-padding batch of num_tokens, unrun."""
        empty = _padding_batch(num_tokens)
        x = self._place(self._host_inputs(empty, *self.shapes_for(empty, rows)))
        assert self._cached_step is not None  # warmup() prepares only with a step cache
        self._cached_step.prepare(_step_key(x.host_tokens, x.meta, x.logit_idx), self.params,
                                  self.kv, self._prev, x.host_tokens, x.token_src, x.meta,
                                  x.logit_idx)

    def _place(self, inputs: StepInputs) -> StepInputs:
        """The step's host inputs where the step takes them: numpy, passed to the jitted
        step as they are; across processes, global arrays."""
        if self.broadcast is not None:
            return self.broadcast.place(inputs)
        return inputs

    def _run(self, inputs: StepInputs, bitmask_fn=None) -> StepOutput:
        fwd = self._dispatch_forward(inputs)
        return self._dispatch_sample(
            inputs, fwd, bitmask_fn(len(inputs.temperature)) if bitmask_fn else None)

    def _dispatch_forward(self, inputs: StepInputs):
        """The step's forward dispatched: (placed inputs, previous tokens, the sampling
        rows' logits, the scored prompt tokens' logprobs or None)."""
        x = self._place(inputs)
        scores = None
        logit_idx = (x.logit_idx if x.score_idx is None  # scored prompt tokens' rows last
                     else np.concatenate([x.logit_idx, x.score_idx]))
        with self._lock:
            prev = self._prev
            with jax.profiler.TraceAnnotation("nanojax.dispatch_forward"):
                self.kv, logits = self._forward(self.params, self.kv, prev, x.host_tokens,
                                                x.token_src, x.meta, logit_idx)
            if x.score_idx is not None:
                logits, scores = self._score(logits, x.score_ids)
        return x, prev, logits, scores

    def _dispatch_sample(self, inputs: StepInputs, forward, bitmask) -> StepOutput:
        x, prev, logits, scores = forward
        # the sampler's variant, from the host arrays before placing them
        sampling = any_sampling(inputs.temperature)
        logprobs = any_logprobs(inputs.wants_logprobs)
        # only penalties read the tokens: one sampler per variant, not one per token
        # bucket too
        host_tokens, token_src = ((x.host_tokens, x.token_src) if x.penalties is not None
                                  else (None, None))
        with self._lock:
            with jax.profiler.TraceAnnotation("nanojax.dispatch_sample"):
                out = self._sample(logits, prev, host_tokens, token_src, x.logit_idx,
                                   x.temperature, x.top_p, x.top_k, x.min_p, x.seeds,
                                   x.steps,
                                   x.penalties, bitmask, sampling=sampling,
                                   logprobs=logprobs)
            self._prev = out[0]
        return StepOutput(out[0], out[1], out[2], out[3], scores)

    def _host_inputs(self, batch, t: int, r: int, p: int) -> StepInputs:
        """The step's host arrays for a batch at shapes (tokens, rows, pages per row).
        The decodes (most rows, one token each, token i in row i) are filled a column at
        a time; the prefill chunks after them row by row."""
        host_tokens = np.zeros(t, np.int32)
        token_src = np.full(t, -1, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        seq_ids = np.zeros(t, np.int32)
        page_table = np.zeros((r, p), np.int32)
        context_lens = np.zeros(r, np.int32)
        logit_idx = np.zeros(r, np.int32)
        temperature = np.zeros(r, np.float32)
        top_p = np.ones(r, np.float32)
        top_k = np.full(r, -1, np.int32)
        min_p = np.zeros(r, np.float32)
        seeds = np.zeros(r, np.uint32)
        steps = np.zeros(r, np.int32)
        wants_logprobs = np.zeros(r, bool)  # only picks the sampler's variant
        scored: list[tuple[int, range, Sequence]] = []  # (its first token's index, ...)
        ps = self.page_size
        entries = batch.entries
        rows, nd = len(entries), batch.num_decodes
        if nd:
            dec = entries[:nd]
            start = np.fromiter((e.start for e in dec), np.int32, nd)
            src = np.fromiter((e.prev_row for e in dec), np.int32, nd)
            token_src[:nd] = src
            for j in np.flatnonzero(src < 0).tolist():  # inputs the host has
                host_tokens[j] = dec[j].seq.token_at(dec[j].start)
            positions[:nd] = start
            page = np.fromiter((e.seq.pages[e.start // ps] for e in dec), np.int32, nd)
            slots[:nd] = page * ps + start % ps
            seq_ids[:nd] = logit_idx[:nd] = np.arange(nd, dtype=np.int32)
            context_lens[:nd] = start + 1
        i = nd
        for row in range(nd, rows):  # prefill chunks
            e = entries[row]
            seq, n, start = e.seq, e.num_tokens, e.start
            pos = np.arange(start, start + n)
            if e.prev_row >= 0:
                token_src[i] = e.prev_row
            else:
                host_tokens[i:i + n] = [seq.token_at(j) for j in pos]
            positions[i:i + n] = pos
            pages = np.asarray(seq.pages, np.int32)
            slots[i:i + n] = pages[pos // ps] * ps + pos % ps
            seq_ids[i:i + n] = row
            context_lens[row] = start + n
            logit_idx[row] = i + n - 1
            if seq.prompt_logprobs is not None:
                scored.append((i, seq.scored_positions(start, n), seq))
            i += n
        if rows:
            tables = self.page_tables
            at = tables.rows([e.seq for e in entries])  # (before .table: it may grow)
            w = min(p, tables.width)
            page_table[:rows, :w] = tables.table[at, :w]
            (temperature[:rows], top_p[:rows], top_k[:rows], min_p[:rows], seeds[:rows],
             wants_logprobs[:rows], processes) = zip(*[e.seq.sampling_row for e in entries])
            steps[:rows] = [len(e.seq.output_ids) + e.seq.pending - e.samples
                            for e in entries]
        history = ([(e.seq.params, e.seq.prompt_ids, e.seq.output_ids) for e in entries]
                   if rows and any(processes) else [])
        penalties = penalty_inputs(history, r, self.cfg.vocab_size, self.max_pages_per_seq
                                   * ps if self.fixed_shapes else None)
        blocks = slot = None
        block_q = self.forward.attention.prefill_block_q
        if block_q:  # query blocks for the chunked-prefill kernel
            blocks, slot = prefill_metadata(seq_ids, positions, batch.num_decodes, i,
                                            block_q, min(r, self.forward.attention
                                                         .prefill_max_seqs))
        # host (numpy) arrays for the pytrees' jax.Array leaves: a pytree's leaves have one
        # type to mypy, numpy here and jax.Array once placed (_place)
        meta = PagedMetadata(positions=positions, slot_mapping=slots, seq_ids=seq_ids,  # type: ignore[arg-type]
                             page_table=page_table, context_lens=context_lens,  # type: ignore[arg-type]
                             num_decodes=np.int32(batch.num_decodes),  # type: ignore[arg-type]
                             prefill_blocks=blocks, prefill_slot=slot)
        score_idx, score_ids = self._score_inputs(scored)
        return StepInputs(host_tokens, token_src, meta, logit_idx, temperature, top_p, top_k,  # type: ignore[arg-type]
                          min_p, seeds, steps, penalties, wants_logprobs, score_idx, score_ids)  # type: ignore[arg-type]

    def _score_inputs(self, scored) -> tuple[np.ndarray | None, np.ndarray | None]:
        """score_idx and score_ids of the chunks' scored positions (in row order; the
        engine reads them back in the same order): their count padded to a power of two,
        or with fixed shapes to the scheduler's cap (one more shape per token bucket)."""
        n = sum(len(pos) for _, pos, _ in scored)
        if not n:
            return None, None
        most = min(MAX_SCORED_TOKENS, self.b_dense)  # (a step holds at most B_dense tokens)
        size = most if self.fixed_shapes or self.constant_batch else bucket(n, 16, most)
        idx, ids = np.zeros(size, np.int32), np.zeros(size, np.int32)
        k = 0
        for first, pos, seq in scored:  # pos starts at the chunk's first token
            m = len(pos)
            idx[k:k + m] = np.arange(first, first + m)
            ids[k:k + m] = seq.prompt_ids[pos.start + 1:pos.stop + 1]
            k += m
        return idx, ids
