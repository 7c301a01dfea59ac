"""Plain reference generation: one sequence, full attention over a contiguous cache.

No paging, no batching, no scheduler: the engines are checked against this path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import ModelConfig
from nanojax.layers.attention import (ContiguousMetadata, contiguous_attention,
                                      init_contiguous_cache)
from nanojax.models import LlamaForCausalLM


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _step_fn(cfg: ModelConfig):
    model = LlamaForCausalLM(cfg)

    def step(params, tokens, positions, cache, last):
        meta = ContiguousMetadata(positions=positions)
        logits, cache = model.apply(params, tokens, cache, meta, contiguous_attention,
                                    logit_indices=last[None])
        return logits[0], cache

    return jax.jit(step, donate_argnums=(3,))


class ReferenceGenerator:
    """Prefill once, then one token per step; the cache has one spare slot for padding."""

    def __init__(self, cfg: ModelConfig, params, max_len: int | None = None):
        self.cfg, self.params = cfg, params
        self.max_len = max_len or min(cfg.max_position_embeddings, 2048)
        self.step = _step_fn(cfg)
        self._memo: dict = {}  # generation is deterministic: repeated checks reuse it

    def logits(self, prompt_ids) -> np.ndarray:
        """f32 logits at every prompt position: [len(prompt), vocab]."""
        n = len(prompt_ids)
        cache = init_contiguous_cache(self.cfg, self.max_len + 1, jnp.dtype(self.cfg.dtype))
        model = LlamaForCausalLM(self.cfg)
        meta = ContiguousMetadata(positions=jnp.arange(n, dtype=jnp.int32))
        logits, _ = jax.jit(lambda p, t, c: model.apply(p, t, c, meta, contiguous_attention))(
            self.params, jnp.asarray(prompt_ids, jnp.int32), cache)
        return np.asarray(logits)

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, stop_ids=(), ignore_eos: bool = False) -> list[int]:
        key = (tuple(int(t) for t in prompt_ids), max_new_tokens, temperature, seed,
               tuple(stop_ids), ignore_eos)
        if key not in self._memo:
            self._memo[key] = self._generate(prompt_ids, max_new_tokens, temperature, seed,
                                             stop_ids, ignore_eos)
        return list(self._memo[key])

    def _generate(self, prompt_ids, max_new_tokens, temperature, seed, stop_ids,
                  ignore_eos) -> list[int]:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the reference cache length {self.max_len}")
        cache = init_contiguous_cache(self.cfg, self.max_len + 1, jnp.dtype(self.cfg.dtype))
        width = _bucket(n)
        tokens = np.zeros(width, np.int32)
        tokens[:n] = prompt_ids
        positions = np.full(width, self.max_len, np.int32)  # padding writes the spare slot
        positions[:n] = np.arange(n)
        logits, cache = self.step(self.params, jnp.asarray(tokens), jnp.asarray(positions),
                                  cache, jnp.int32(n - 1))
        rng = np.random.default_rng(seed)
        out: list[int] = []
        for i in range(max_new_tokens):
            tok = _pick(np.asarray(logits), temperature, rng)
            out.append(tok)
            if tok in stop_ids and not ignore_eos:
                break
            if i + 1 == max_new_tokens:
                break
            logits, cache = self.step(self.params, jnp.asarray([tok], jnp.int32),
                                      jnp.asarray([n + i], jnp.int32), cache, jnp.int32(0))
        return out


def _pick(logits: np.ndarray, temperature: float, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
