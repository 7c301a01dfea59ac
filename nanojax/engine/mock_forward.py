"""A stand-in model forward for the engine's own tests and its host benchmark.

It has the engine's shapes (packed tokens in, one row of logits per sampling row out, a
paged cache per layer) and almost no device work, so what is measured or tested is the
engine around it: scheduling, the step's inputs, paging, reading tokens back, streaming.
The next token is a fixed function of a token and its position (`mock_next_token`), so a
request's output is known in advance whatever it is batched with, like JetStream's mock
engine. Each token is written into its cache slot, so paging mistakes show up in the
cache (tests read it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import ModelConfig
from nanojax.errors import UnsupportedError
from nanojax.layers.attention import AttentionBackend, paged_attention

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from nanojax.engine.forward import Forward


def mock_next_token(token, position, vocab_size: int):
    """The token the mock model predicts after `token` at `position` (numpy or jax)."""
    return (token * 31 + position + 1) % vocab_size


def mock_outputs(prompt: list[int], max_tokens: int, vocab_size: int) -> list[int]:
    """The greedy output the mock model gives a prompt (what tests compare against)."""
    out, token, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(max_tokens):
        token = int(mock_next_token(token, pos, vocab_size))
        out.append(token)
        pos += 1
    return out


def mock_params(num_layers: int, leaves_per_layer: int = 9) -> dict:
    """A parameter tree with as many leaves as a LLaMA's (each a scalar): what the step's
    dispatch flattens every iteration, without the weights."""
    layers = {f"layers_{i}": {f"w{j}": np.zeros((), np.float32)
                              for j in range(leaves_per_layer)} for i in range(num_layers)}
    return {"params": {"embed": np.zeros((), np.float32), "norm": np.zeros((), np.float32),
                       "lm_head": np.zeros((), np.float32), **layers}}


class MockForward:
    """The Forward protocol (engine/forward.py) over no model: logits put all the mass on
    mock_next_token of each sampling row's last token."""

    attention: AttentionBackend = paged_attention  # its metadata only; nothing attends
    chunk_cuts: tuple[int, ...] = ()
    kv_page_axis = 0
    traced = True
    num_traces = 0
    mesh: Mesh | None = None
    top_logprobs: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] | None = None

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.compiler_options: dict = {}

    def layout(self, params, stack=jnp.stack):
        return params

    def for_shard(self, cfg: ModelConfig, tp_axis: str) -> "MockForward":
        raise UnsupportedError("the mock forward runs on one device")

    def prepare(self, params):
        return jax.device_put(params)

    def init_kv(self, num_pages: int, page_size: int, dtype=None):
        """One [pages, 1, page_size, 1] int32 array per layer: each slot holds its token."""
        return [jnp.full((num_pages, 1, page_size, 1), -1, jnp.int32)
                for _ in range(self.cfg.num_layers)]

    def __call__(self, params, tokens, kv, meta, logit_idx):
        slots = meta.slot_mapping
        kv = [_write_slots(pages, slots, tokens) for pages in kv]
        last = tokens[logit_idx]
        nxt = mock_next_token(last, meta.positions[logit_idx], self.cfg.vocab_size)
        logits = jnp.where(jnp.arange(self.cfg.vocab_size)[None, :] == nxt[:, None],
                           0.0, -1e9).astype(jnp.float32)
        return logits, kv


def _write_slots(pages, slots, tokens):
    flat = pages.reshape(-1)
    flat = flat.at[jnp.where(slots >= 0, slots, flat.shape[0])].set(tokens, mode="drop")
    return flat.reshape(pages.shape)


if TYPE_CHECKING:  # mypy (.ci/run) checks that the mock is a Forward
    _FORWARD: type[Forward] = MockForward
