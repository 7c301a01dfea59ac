"""Per-request sampling parameters and the on-device sampler.

Each row draws from its own key, fold_in(PRNGKey(seed), output_index), so a seeded request
samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nanojax.errors import NanojaxError

MAX_LOGPROBS = 20


class SamplingError(NanojaxError, ValueError):
    pass


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0: no top-k
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities to return per token
    min_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.validate()

    def validate(self) -> None:
        def bad(field, msg):
            raise SamplingError(f"{field} {msg}, got {getattr(self, field)!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not 0.0 <= float(self.temperature) <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if not 0.0 < float(self.top_p) <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (off) or a non-negative integer")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad("seed", "must be a non-negative integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits, temperature, top_p, top_k, seeds, steps, top_logprobs=None):
    """logits [R, V] f32; per-row temperature, top_p, top_k (<=0: off), seeds [R] uint32x2,
    steps [R] -> (tokens [R], chosen logprob [R], top ids [R, K], top logprobs [R, K]).
    top_logprobs(logprobs, k) -> (values, ids): lax.top_k unless given (tensor parallelism
    passes one that reads each vocabulary shard on its device, parallel/tp.py); the
    chosen logprob is then a masked sum (one value plus zeros: exact), which also reduces
    per shard. The top-k/top-p sort, run only when a row asks for it, sees whole rows."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_t[:, None]

    def filtered(scaled):
        """top-k and top-p masks from one descending sort (skipped when no row asks)."""
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

    def sampled(scaled):
        needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
        masked = jax.lax.cond(needs_filter, filtered, lambda x: x, scaled)
        drawn = jax.vmap(draw)(seeds, steps, masked).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy_tok)

    tokens = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy_tok, scaled)
    if top_logprobs is not None:
        hit = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :] == tokens[:, None]
        chosen = jnp.sum(jnp.where(hit, logprobs, 0.0), axis=-1)
        top_lp, top_ids = top_logprobs(logprobs, MAX_LOGPROBS)
        return tokens, chosen, top_ids.astype(jnp.int32), top_lp
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp
