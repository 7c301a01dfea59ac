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


@functools.lru_cache(maxsize=8)
def _rows_step_fn(cfg: ModelConfig):
    """The same one-sequence step vmapped over rows, each row its own sequence and cache."""
    return jax.jit(jax.vmap(_step_fn(cfg).__wrapped__, in_axes=(None, 0, 0, 0, 0)),
                   donate_argnums=(3,))


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
        self._check_length(n, max_new_tokens)
        logits, cache = self._prefill(prompt_ids)
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


    def _check_length(self, n: int, max_new_tokens: int) -> None:
        if n == 0:
            raise ValueError("empty prompt")
        if n + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the reference cache length {self.max_len}")

    def _prefill(self, prompt_ids):
        """(logits of the last prompt token, the cache holding the prompt)."""
        n = len(prompt_ids)
        cache = init_contiguous_cache(self.cfg, self.max_len + 1, jnp.dtype(self.cfg.dtype))
        width = _bucket(n)
        tokens = np.zeros(width, np.int32)
        tokens[:n] = prompt_ids
        positions = np.full(width, self.max_len, np.int32)  # padding writes the spare slot
        positions[:n] = np.arange(n)
        return self.step(self.params, jnp.asarray(tokens), jnp.asarray(positions), cache,
                         jnp.int32(n - 1))

    def generate_many(self, prompts, max_new_tokens, stop_ids=(),
                      ignore_eos: bool = False) -> list[list[int]]:
        """Greedy generate() of many prompts at once (max_new_tokens: one int or one per
        prompt): the one-sequence step vmapped over the prompts, each with its own cache,
        so the weights are read once a step for all of them (tests check dozens of
        requests; one at a time was most of their time). Fills generate()'s memo."""
        news = ([int(max_new_tokens)] * len(prompts) if np.ndim(max_new_tokens) == 0
                else [int(m) for m in max_new_tokens])
        todo = {}
        for p, m in zip(prompts, news):
            key = (tuple(int(t) for t in p), m, 0.0, 0, tuple(stop_ids), ignore_eos)
            if key not in self._memo:
                todo[key] = None
        if todo:
            outs = self._generate_rows([list(k[0]) for k in todo], [k[1] for k in todo],
                                       tuple(stop_ids), ignore_eos)
            self._memo.update(zip(todo, outs))
        return [self.generate(p, m, stop_ids=stop_ids, ignore_eos=ignore_eos)
                for p, m in zip(prompts, news)]

    def _generate_rows(self, prompts, news, stop_ids, ignore_eos) -> list[list[int]]:
        lens = [len(p) for p in prompts]
        for n, m in zip(lens, news):
            self._check_length(n, m)
        rows, spare = len(prompts), self.max_len  # padding and finished rows write here
        # prefill one prompt at a time (generate()'s own call: vmapped, the contiguous
        # attention's per-token copy of the cache grows with the rows), decode together
        firsts, caches = zip(*(self._prefill(p) for p in prompts))
        logits = jnp.stack(firsts)
        cache = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *caches)
        step = _rows_step_fn(self.cfg)
        outs: list[list[int]] = [[] for _ in prompts]
        live = [m > 0 for m in news]
        for i in range(max(news)):
            picks = np.asarray(logits).argmax(-1)
            for r in range(rows):
                if live[r]:
                    outs[r].append(int(picks[r]))
                    live[r] = (len(outs[r]) < news[r]
                               and (ignore_eos or outs[r][-1] not in stop_ids))
            if not any(live):
                break
            pos = [lens[r] + i if live[r] else spare for r in range(rows)]
            logits, cache = step(self.params, jnp.asarray(picks[:, None].astype(np.int32)),
                                 jnp.asarray(pos, jnp.int32)[:, None], cache,
                                 jnp.zeros(rows, jnp.int32))
        return outs


def _pick(logits: np.ndarray, temperature: float, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
