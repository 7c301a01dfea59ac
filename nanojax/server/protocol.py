"""OpenAI request validation: JSON bodies in, SamplingParams and prompts out, or an
ApiError that becomes a 4xx with an OpenAI-style body."""
from __future__ import annotations

import dataclasses
from typing import Any

from nanojax.engine.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16
MAX_STOP = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, key: str, kind: str, default=None, lo=None, hi=None, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    if kind == "int" and not _is_int(v):
        raise bad(key, f"'{key}' must be an integer, got {type(v).__name__}")
    if kind == "num" and not _is_num(v):
        raise bad(key, f"'{key}' must be a number, got {type(v).__name__}")
    if kind == "bool" and not isinstance(v, bool):
        raise bad(key, f"'{key}' must be a boolean, got {type(v).__name__}")
    if kind == "str" and not isinstance(v, str):
        raise bad(key, f"'{key}' must be a string, got {type(v).__name__}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(key, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(key, f"'{key}' must be <= {hi}, got {v}")
    return v


@dataclasses.dataclass
class ParsedRequest:
    prompts: list            # each a string or a list of token ids
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    max_tokens_given: bool
    logprobs: int | None     # top-k to return, None: no logprobs
    echo_chat: bool = False


def _sampling(body: dict, max_tokens, logprobs) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or len(stop) > MAX_STOP
                or not all(isinstance(s, str) and s for s in stop)):
            raise bad("stop", f"'stop' must be a non-empty string or a list of at most "
                              f"{MAX_STOP} non-empty strings")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list)
                                 or not all(_is_int(t) for t in stop_ids)):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
    seed = _get(body, "seed", "int")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad("seed", f"'seed' must be in [0, 2^63), got {seed}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", "num", 1.0, 0.0, 2.0)),
        top_p=float(_get(body, "top_p", "num", 1.0, 0.0, 1.0, lo_open=True)),
        top_k=_get(body, "top_k", "int", -1, -1),
        seed=seed, stop=stop, stop_token_ids=stop_ids,
        ignore_eos=_get(body, "ignore_eos", "bool", False),
        logprobs=logprobs,
        min_tokens=min(_get(body, "min_tokens", "int", 0, 0), max_tokens))


def _common(body: dict) -> tuple[int, bool, bool]:
    n = _get(body, "n", "int", 1, 1, MAX_N)
    stream = _get(body, "stream", "bool", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "'stream_options' must be an object")
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed with 'stream': true")
        include_usage = _get(opts, "include_usage", "bool", False)
    return n, stream, include_usage


def parse_completion(body: dict, vocab_size: int) -> ParsedRequest:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "'prompt' is required")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            _is_int(t) for t in p) for p in prompt)):
        prompts = list(prompt)
    else:
        raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token "
                            "ids, or a list of token-id lists (none empty)")
    for p in prompts:
        if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
            raise bad("prompt", f"prompt token ids must be in [0, {vocab_size})")
        if isinstance(p, str) and not p:
            raise bad("prompt", "'prompt' must not be empty")
    n, stream, include_usage = _common(body)
    max_tokens = _get(body, "max_tokens", "int", 16, 1)
    logprobs = _get(body, "logprobs", "int", None, 0, MAX_LOGPROBS)
    if _get(body, "echo", "bool", False):
        raise bad("echo", "'echo' is not supported")
    params = _sampling(body, max_tokens, logprobs)
    return ParsedRequest(prompts, params, n, stream, include_usage,
                         "max_tokens" in body and body["max_tokens"] is not None, logprobs)


def _message_text(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}]", f"messages[{i}] must be an object")
    role = m.get("role")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of system, user, "
                                         f"assistant, developer, tool; got {role!r}")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: dict) -> tuple[list[dict], ParsedRequest]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    messages = [_message_text(i, m) for i, m in enumerate(msgs)]
    n, stream, include_usage = _common(body)
    max_tokens = _get(body, "max_completion_tokens", "int", None, 1)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", "int", None, 1)
    given = max_tokens is not None
    want_lp = _get(body, "logprobs", "bool", False)
    top = _get(body, "top_logprobs", "int", None, 0, MAX_LOGPROBS)
    if top is not None and not want_lp:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
    logprobs = (top or 0) if want_lp else None
    params = _sampling(body, max_tokens or 1, logprobs)
    return messages, ParsedRequest([], params, n, stream, include_usage, given, logprobs)
