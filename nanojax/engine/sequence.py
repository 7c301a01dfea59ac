"""Request state as the scheduler and engine see it."""
from __future__ import annotations

import enum
import time

import numpy as np
from typing import TYPE_CHECKING

from nanojax.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import concurrent.futures

    from llguidance import LLMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request. Tokens are prompt + confirmed outputs; `pending` counts tokens sampled on
    the device whose values the host has not read yet (async scheduling keeps one in flight).
    `num_computed` counts tokens whose KV is written or being written by launched steps."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 eos_ids: tuple[int, ...] = (), arrival: float | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        # the step's per-row sampling inputs, read every iteration: (temperature, top_p,
        # top_k, min_p, seed as uint32, wants logprobs, processes logits)
        self.sampling_row = (params.temperature, params.top_p, params.top_k, params.min_p,
                             (params.seed or 0) & 0xFFFFFFFF, params.logprobs is not None,
                             params.processes_logits)
        # something other than max_tokens may end it (EOS, stop strings or ids): its
        # expected length is the mean finished output (scheduler.expected_length)
        self.can_stop = bool(not params.ignore_eos or params.stop or params.stop_token_ids)
        self.eos_ids = tuple(eos_ids)
        self.status = Status.WAITING
        self.pages: list[int] = []
        self.block_hashes: list[bytes] = []   # hash chain of its full pages (prefix cache)
        self.num_cached_pages = 0             # leading pages in the prefix cache
        # an offload tier's pages on their way into its pages (a Future of the staged
        # copies): not scheduled, and its loaded pages not cached, until it is done
        self.loading: concurrent.futures.Future | None = None
        self.num_computed = 0
        self.pending = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.logprobs: list[dict] = []
        # prompt_logprobs: one entry per prompt token, None for the first (nothing before
        # it) and until the step that scores it is read
        self.prompt_logprobs: list[dict | None] | None = (
            [None] * len(self.prompt_ids) if params.prompt_logprobs is not None else None)
        self.text = ""            # detokenized output (maintained by the engine)
        self.text_ids_end: int | None = None  # output tokens the text covers (None: all)
        self.sent_text_len = 0    # how much text was already streamed
        self.sent_tokens = 0
        self.matcher: LLMatcher | None = None  # structured outputs: its llguidance matcher, fed its tokens
        # allowed_token_ids as a packed mask (structured.token_mask; set by the engine)
        self.allowed_mask: np.ndarray | None = None
        # bad_words as token sequences (structured.bad_words_token_ids; set by the engine)
        self.bad_words_ids: list[tuple[int, ...]] | None = None

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_total(self) -> int:
        """Tokens that exist, including the one still on the device."""
        return self.num_known + self.pending

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.pending

    def scored_positions(self, start: int, num_tokens: int) -> range:
        """Of a chunk of positions [start, start + num_tokens), those whose logits score
        the prompt token after them (prompt_logprobs; none otherwise)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(start, max(start, min(start + num_tokens, len(self.prompt_ids) - 1)))

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def finish(self, reason: str, stop_reason=None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
