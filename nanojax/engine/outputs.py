"""What the engine hands back to callers (shaped like vLLM's RequestOutput)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None       # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None   # the stop string or token id that matched
    logprobs: list[dict] | None = None     # per token: {"token_id", "logprob", "top": [(id, lp)]}


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # metrics: seconds since arrival
    first_token_latency: float | None = None
    num_preemptions: int = 0
    # streaming: what is new since the last output of this request
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else as
    # CompletionOutput.logprobs' entries plus "rank" (1: the model's likeliest)
    prompt_logprobs: list[dict | None] | None = None

    # single-completion conveniences
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
