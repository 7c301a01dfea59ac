"""Per-request sampling parameters and the on-device sampler.

Each row draws from its own key, fold_in(PRNGKey(seed), output_index), so a seeded request
samples the same tokens whatever else shares its batch.

Logit processing follows vLLM: logit_bias is added first, then the repetition penalty
(prompt and generated tokens), frequency and presence penalties (generated tokens only);
then temperature, top-k, top-p. Returned log-probabilities are the model's, before any of
these. The processing runs only in steps where some row asks for it (`Penalties`).
A structured-output row's grammar mask (engine/structured.py) is applied after them, in
steps where some row is constrained (`sample(bitmask=...)`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.engine.structured import (GrammarMasks, StructuredOutputError,
                                       StructuredOutputsParams)
from nanojax.errors import NanojaxError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300       # entries per request
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 256
INT32_MAX = 2**31 - 1
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


class SamplingError(NanojaxError, ValueError):
    pass


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0: no top-k
    min_p: float = 0.0       # [0, 1]: keep tokens at least min_p x the likeliest's probability
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    skip_special_tokens: bool = True          # the text leaves special tokens out
    logprobs: int | None = None  # number of top log-probabilities to return per token
    # the same for each prompt token after the first (vLLM's; scores a text, lm-eval's
    # loglikelihood): its prompt is run in full, not read from the prefix cache
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0    # [-2, 2], subtracted once from every generated token
    frequency_penalty: float = 0.0   # [-2, 2], subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # (0, 10]: > 1 discourages prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    # the only tokens it may sample (vLLM's; a mask on the device, as a grammar's)
    allowed_token_ids: list[int] | None = None
    # words it must not write (vLLM's): each word's last token is masked where the output
    # so far ends with the rest of it (bad_words_token_ids in structured.py)
    bad_words: list[str] | None = None
    # a grammar the output must match (a StructuredOutputsParams or its fields as a dict)
    structured_outputs: StructuredOutputsParams | dict | None = None
    # what each RequestOutput of the request holds (vLLM's RequestOutputKind): cumulative
    # (everything so far, each step), delta (only what is new since the last one: a
    # stream), final_only (one output, when it finishes: offline and non-streaming use)
    output_kind: str = "cumulative"

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except (TypeError, StructuredOutputError) as e:  # TypeError: an unknown field
                raise SamplingError(f"structured_outputs: {e}") from None
        self.validate()

    def validate(self) -> None:
        def bad(field, msg):
            raise SamplingError(f"{field} {msg}, got {str(getattr(self, field))[:80]}")

        def in_range(field, lo, hi, lo_open=False):
            v = getattr(self, field)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or not (lo < v if lo_open else lo <= v) or not v <= hi:
                bad(field, f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}]")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= INT32_MAX:
            bad("max_tokens", "must be an integer >= 1")
        in_range("temperature", 0.0, 100.0)
        in_range("top_p", 0.0, 1.0, lo_open=True)
        in_range("min_p", 0.0, 1.0)
        in_range("presence_penalty", -2.0, 2.0)
        in_range("frequency_penalty", -2.0, 2.0)
        in_range("repetition_penalty", 0.0, 10.0, lo_open=True)
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= INT32_MAX:
            bad("top_k", "must be -1 (off) or a non-negative integer below 2^31")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                bad(flag, "must be a boolean")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad("seed", "must be a non-negative integer")
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(self, field)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                                  or not 0 <= k <= MAX_LOGPROBS):
                bad(field, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        # as __post_init__ left them: lists and a dict, not None or a str
        stop = cast(list[str], self.stop)
        stop_token_ids = cast(list[int], self.stop_token_ids)
        logit_bias = cast(dict[int, float], self.logit_bias)
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be non-empty strings")
        if (len(stop_token_ids) > MAX_STOP_TOKEN_IDS
                or any(not 0 <= t <= INT32_MAX for t in stop_token_ids)):
            bad("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} non-negative ids")
        if len(logit_bias) > MAX_LOGIT_BIAS or any(
                not 0 <= k <= INT32_MAX or not -100.0 <= v <= 100.0  # NaN fails too
                for k, v in logit_bias.items()):
            bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases in "
                              "[-100, 100]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not 0 <= t <= INT32_MAX for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS
                or any(not isinstance(w, str) or not w.strip() or not _utf8(w)
                       for w in self.bad_words)):
            bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} words "
                             "(non-blank strings of valid Unicode)")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"must be one of {OUTPUT_KINDS}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in stop_token_ids and logit_bias must name tokens of the model."""
        for field, ids in (("stop_token_ids", cast(list[int], self.stop_token_ids)),
                           ("logit_bias", cast(dict[int, float], self.logit_bias)),
                           ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingError(f"{field}: token id {bad[0]} is outside the vocabulary "
                                    f"[0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether this request needs the penalty / logit-bias pass on its logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


def _utf8(text: str) -> bool:
    """Whether text is valid Unicode (a lone surrogate is not: no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Penalties(NamedTuple):
    """Device inputs of the logit-processing pass, one row per logits row. Padding ids are
    the vocabulary size (dropped by the scatters)."""
    token_ids: jax.Array    # [R, L] int32: prompt and/or generated tokens the host knows
    is_output: jax.Array    # [R, L] bool: the token was generated (else: prompt)
    presence: jax.Array     # [R] f32
    frequency: jax.Array    # [R] f32
    repetition: jax.Array   # [R] f32 (1: off)
    bias_ids: jax.Array     # [R, K] int32
    bias_values: jax.Array  # [R, K] f32


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def penalty_inputs(rows: list, num_rows: int, vocab_size: int,
                   max_context: int | None = None) -> Penalties | None:
    """Host arrays of the logit-processing pass for rows [(params, prompt_ids, output_ids)]
    (the output ids the host knows), padded to num_rows; None when no row asks, so the
    step compiles and runs without the pass. Lengths are bucketed to bound recompiles;
    with max_context, fixed (the context and MAX_LOGIT_BIAS): one more shape per step."""
    asks = [(r, p, pr, out) for r, (p, pr, out) in enumerate(rows) if p.processes_logits]
    if not asks:
        return None

    def history(p, prompt, out):  # the prompt matters to the repetition penalty only
        return (list(prompt) if p.repetition_penalty != 1.0 else []) + list(out)

    hist = {r: history(p, pr, out) for r, p, pr, out in asks}
    length = _bucket(max(len(h) for h in hist.values()))
    width = _bucket(max(len(p.logit_bias) for _, p, _, _ in asks))
    if max_context is not None:
        length, width = max(length, _bucket(max_context)), MAX_LOGIT_BIAS
    ids = np.full((num_rows, length), vocab_size, np.int32)
    is_out = np.zeros((num_rows, length), bool)
    presence = np.zeros(num_rows, np.float32)
    frequency = np.zeros(num_rows, np.float32)
    repetition = np.ones(num_rows, np.float32)
    bias_ids = np.full((num_rows, width), vocab_size, np.int32)
    bias_values = np.zeros((num_rows, width), np.float32)
    for r, p, prompt, out in asks:
        h = hist[r]
        ids[r, :len(h)] = h
        is_out[r, len(h) - len(out):len(h)] = True
        presence[r], frequency[r] = p.presence_penalty, p.frequency_penalty
        repetition[r] = p.repetition_penalty
        if p.logit_bias:
            bias_ids[r, :len(p.logit_bias)] = list(p.logit_bias)
            bias_values[r, :len(p.logit_bias)] = list(p.logit_bias.values())
    # host arrays where the annotations say jax.Array: a pytree has one leaf type in
    # Python's types, numpy here and jax.Array once placed on the device
    return Penalties(ids, is_out, presence, frequency, repetition, bias_ids, bias_values)  # type: ignore[arg-type]


def with_pending(pen: Penalties, pending_ids, pending_valid) -> Penalties:
    """Adds each row's generated token that is still on the device (async scheduling: the
    previous step's sample, this step's input) as one more generated-token column."""
    vocab_pad = jnp.iinfo(jnp.int32).max
    col = jnp.where(pending_valid, pending_ids, vocab_pad)[:, None].astype(jnp.int32)
    return pen._replace(token_ids=jnp.concatenate([pen.token_ids, col], axis=1),
                        is_output=jnp.concatenate([pen.is_output, pending_valid[:, None]],
                                                  axis=1))


def apply_penalties(logits, pen: Penalties):
    """vLLM's order: logit_bias, then repetition (seen in prompt or output), frequency
    (output counts) and presence (seen in output). Rows that ask for none are unchanged."""
    logits = jnp.asarray(logits)
    r, v = logits.shape
    rows = jnp.arange(r)[:, None]
    logits = logits.at[rows, pen.bias_ids].add(pen.bias_values, mode="drop")
    counts = jnp.zeros((r, v), jnp.float32).at[rows, pen.token_ids].add(
        pen.is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((r, v), jnp.bool_).at[rows, pen.token_ids].set(True, mode="drop")
    rep = pen.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - pen.frequency[:, None] * counts
            - pen.presence[:, None] * (counts > 0).astype(jnp.float32))


def apply_bitmask(logits, bitmask, rows=None):
    """Grammar masks: bitmask [R, ceil(V/32)] int32 as llguidance packs it (bit j of word w
    allows token 32w + j), unpacked here on the device; disallowed tokens get -inf. With
    rows [N] (GrammarMasks), bitmask holds N rows' masks only: scattered into an allow-all
    mask first (rows past R dropped).
    Under tensor parallelism the logits are vocab-sharded and this elementwise select is
    sharded with them (the packed mask is small and replicated)."""
    r, v = logits.shape
    if rows is not None:
        bitmask = every_row_mask(bitmask, rows, r)
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(r, -1)[:, :v] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def every_row_mask(bitmask, rows, num_rows: int):
    """N rows' packed masks [N, W] -> every row's [num_rows, W]: the others allow all."""
    return jnp.full((num_rows, bitmask.shape[1]), -1, jnp.int32).at[rows].set(
        bitmask, mode="drop")


def any_sampling(temperature) -> bool:
    """Host side: whether a batch's rows need the sampling path (`sample(sampling=...)`)."""
    return bool(np.any(np.asarray(temperature) > 0))


def any_logprobs(wants) -> bool:
    """Host side: whether any row of a batch asks for log-probabilities
    (`sample(logprobs=...)`)."""
    return bool(np.any(np.asarray(wants)))


SAMPLER_BLOCK_BYTES = 128 << 20  # one [rows, vocab] f32 buffer of a sampling block


def sampler_block_rows(rows: int, vocab: int, block_bytes: int | None = None) -> int:
    """Rows of a block of the sampling path: as few equal blocks as keep each [rows, vocab]
    f32 buffer within block_bytes (SAMPLER_BLOCK_BYTES; one row at least)."""
    per_block = max(1, (block_bytes or SAMPLER_BLOCK_BYTES) // (4 * vocab))
    n = max(1, -(-rows // per_block))
    return max(1, -(-rows // n))


def in_row_blocks(fn, args, block_rows: int | None = None):
    """fn(*args) computed block of rows by block of rows, one block after another: args
    are per-row arrays [R, ...] or pytrees of them (None passes through), fn's outputs
    per-row arrays (a pytree). Each [rows, vocab] f32 buffer fn makes is then a block's
    (block_rows: default sampler_block_rows of the first arg, the logits), not the batch's. The loop is
    lax.map's, of a known trip count, which XLA's GPU runtime runs without reading a
    predicate back to the host (a cond would make the host wait for the step). fn must
    treat each row on its own: a row's tokens, ids and ranks are then the same in any
    block (float values to rounding: XLA may sum a block's row in another order)."""
    rows = args[0].shape[0]
    size = block_rows or sampler_block_rows(*args[0].shape)
    if rows <= size:  # one block (or no rows): no loop, no slicing
        return fn(*args)
    full = rows // size * size
    part = lambda lo, hi: jax.tree.map(lambda a: a[lo:hi], list(args))  # noqa: E731
    parts = []
    if full == size:
        parts.append(fn(*part(0, size)))
    elif full:
        blocks = jax.tree.map(
            lambda a: a[:full].reshape(full // size, size, *a.shape[1:]), list(args))
        looped = jax.lax.map(lambda b: fn(*b), blocks)
        parts.append(jax.tree.map(lambda o: o.reshape(full, *o.shape[2:]), looped))
    if full < rows:
        parts.append(fn(*part(full, rows)))
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def sample(logits, temperature, top_p, top_k, seeds, steps, penalties: Penalties | None = None,
           top_logprobs=None, sampling: bool = True, logprobs: bool = True,
           bitmask: GrammarMasks | None = None, min_p=None):
    """logits [R, V] f32; per-row temperature, top_p, top_k (<=0: off), seeds [R] uint32x2,
    steps [R], min_p [R] (0: off; the runner always passes it: one mask fused into the
    draw) or None; penalties: None or the logit-processing pass's inputs; bitmask: the
    constrained rows' grammar masks (apply_bitmask), None when no row is -> (tokens [R],
    chosen logprob [R], top ids [R, K], top logprobs [R, K]).
    sampling: static, decided on the host (any_sampling): False when every row is greedy,
    so the step holds no draw and no sort. It is not a lax.cond on the device: on a GPU
    XLA runs a conditional by copying its predicate to the host and blocking until the
    device gets there, so one cond at the end of the step made the host wait for the
    whole step every iteration (no dispatch ahead). logprobs: static, decided on the
    host (any_logprobs): False when no row asks, so the step skips the log-softmax and the
    top-20 (on a GPU a radix sort of every row's vocabulary, a sizeable share of the
    iteration: bench/results/log/engine_host.md) and returns zeros and [R, 0] tops. With
    sampling, in blocks of rows (sampler_block_rows: its buffers' memory is a block's, not
    the batch's), each row that asks for top-k or top-p is masked from one descending sort;
    the others are not touched, so a row's draw never depends on the rest of the batch.
    min_p applies first, to the tempered distribution, as vLLM's sampler: top-p's mass is
    then counted over what min_p kept.
    top_logprobs(logprobs, k) -> (values, ids): lax.top_k unless given (tensor parallelism
    passes one that reads each vocabulary shard on its device, parallel/tp.py); the
    chosen logprob is then a masked sum (one value plus zeros: exact), which also reduces
    per shard. The top-k/top-p sort sees whole rows."""
    want_logprobs, logits_in = logprobs, logits
    # penalties and grammar masks each make a [rows, vocab] copy or more of the logits (a
    # count, a seen flag, the unpacked bits: GBs at 2,048 rows x 128k): in the draw's row
    # blocks, where only the greedy token and the draw read the processed logits
    mask = None if bitmask is None else every_row_mask(bitmask.mask, bitmask.rows,
                                                       logits.shape[0])

    def processed(x, pen, mask):
        if pen is not None:
            x = apply_penalties(x, pen)
        if mask is not None:
            x = apply_bitmask(x, mask)
        return x

    def filtered(scaled, top_k, top_p):
        """top-k and top-p masks from one descending sort."""
        sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
        vocab = logits.shape[-1]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
        probs_sorted = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs_sorted, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cutoff_idx = jnp.sum(cum - probs_sorted < top_p[:, None], axis=-1) - 1
        pth = jnp.take_along_axis(sorted_logits, cutoff_idx[:, None], axis=-1)
        return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, -jnp.inf)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        return jax.random.categorical(key, row)

    def drawn_rows(x, t, k, p, m, seed, step, greedy):
        """The draw of a block of rows (their logits x and parameters): every op is per
        row, so a row's token is the same whichever block it is drawn in."""
        x = x / jnp.where(t > 0, t, 1.0)[:, None]
        if m is not None:  # p >= min_p * p_max, i.e. a logit >= the top one + log(min_p)
            # the top logit is the greedy token's: a gather, not another pass over the vocab
            top = jnp.take_along_axis(x, greedy[:, None], axis=-1)[:, 0]
            floor = top + jnp.log(jnp.where(m > 0, m, 1.0))
            x = jnp.where((m[:, None] > 0) & (x < floor[:, None]), -jnp.inf, x)
        wants_filter = (k > 0) | (p < 1.0)
        x = jnp.where(wants_filter[:, None], filtered(x, k, p), x)
        return jax.vmap(draw)(seed, step, x).astype(jnp.int32)

    def block_tokens(x, pen, mask, t, k, p, m, seed, step):
        x = processed(x, pen, mask)
        greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
        if not sampling:
            return greedy
        return jnp.where(t > 0, drawn_rows(x, t, k, p, m, seed, step, greedy), greedy)

    if not sampling and penalties is None and mask is None:  # one pass over the logits
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        # in blocks of rows (in_row_blocks): the sort, its softmax and cumsum and the
        # noise are each a [rows, vocab] f32 buffer, 6.85 GiB together at 2,048 rows x
        # 128k (an H100 out of memory, bench/results/log/fp8.md §91); a block's are small
        tokens = in_row_blocks(block_tokens, (logits, penalties, mask, temperature, top_k,
                                              top_p, min_p, seeds, steps))
    if not want_logprobs:
        rows = tokens.shape[0]
        return (tokens, jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, 0), jnp.int32),
                jnp.zeros((rows, 0), jnp.float32))
    chosen, _, top_ids, top_lp = token_logprobs(logits_in, tokens, top_logprobs)
    return tokens, chosen, top_ids, top_lp


def token_logprobs(logits, tokens, top_logprobs=None, rank: bool = False):
    """The model's log-probabilities of logits [R, V] (before any processing): each row's
    token's [R], with its rank (1: the likeliest; zeros unless rank) [R], and the top
    MAX_LOGPROBS ids [R, K] and values [R, K]. top_logprobs: as sample()'s; with it the
    token's value is a masked sum, which reduces per vocabulary shard. In blocks of rows
    (in_row_blocks): the log-softmax and the top-k's sort of 2,048 rows x 128k are
    several GB together."""
    return in_row_blocks(lambda lg, tok: _token_logprobs_rows(lg, tok, top_logprobs, rank),
                         (logits, tokens))


def _token_logprobs_rows(logits, tokens, top_logprobs, rank: bool):
    all_lp = jax.nn.log_softmax(logits, axis=-1)
    if top_logprobs is not None:
        hit = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :] == tokens[:, None]
        chosen = jnp.sum(jnp.where(hit, all_lp, 0.0), axis=-1)
        top_lp, top_ids = top_logprobs(all_lp, MAX_LOGPROBS)
    else:
        chosen = jnp.take_along_axis(all_lp, tokens[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(all_lp, MAX_LOGPROBS)
    ranks = (1 + jnp.sum(all_lp > chosen[:, None], axis=-1, dtype=jnp.int32) if rank
             else jnp.zeros(tokens.shape, jnp.int32))
    return chosen, ranks, top_ids.astype(jnp.int32), top_lp
