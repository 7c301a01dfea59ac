"""OpenAI request validation: JSON bodies in, SamplingParams and prompts out, or an
ApiError that becomes a 4xx with an OpenAI-style body.

Everything a client sends is checked here, before any of it reaches the engine thread:
JSON that Python parses but no strict parser would (NaN, Infinity, integers beyond 4,300
digits, nesting deeper than MAX_DEPTH, lone UTF-16 surrogates), numbers outside their
range or not finite, and token ids outside the vocabulary.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from nanojax.engine.sampling import (INT32_MAX, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                     MAX_STOP_TOKEN_IDS, SamplingError, SamplingParams)
from nanojax.engine.structured import StructuredOutputError, StructuredOutputsParams
from nanojax.server.api_error import ApiError, bad, brief  # noqa: F401 - importers use them here
from nanojax.server.tools import parse_tools

MAX_N = 16
MAX_STOP = 4
MAX_BAD_WORD_CHARS = 256
MAX_DEPTH = 32   # JSON nesting; OpenAI bodies need 5
# fields of the OpenAI / vLLM APIs this server does not implement: (field, value allowed)
UNSUPPORTED = {"suffix": lambda v: v in (None, ""),
               "best_of": lambda v: v in (None, 1),
               "functions": lambda v: v in (None, []),
               "function_call": lambda v: v in (None, "none")}
# vLLM's older names of the structured_outputs fields
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _no_constant(name: str):
    raise ApiError(400, f"request body is not valid JSON: {name} is not a JSON value")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"request body is nested too deeply (limit {MAX_DEPTH})") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, 4,300+ digit integers
        why = ("an integer has more than 4,300 digits" if "integer string conversion" in str(e)
               else brief(str(e), 200)[1:-1])
        raise ApiError(400, f"request body is not valid JSON: {why}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Depth and strings of the whole body, iteratively (a deep body must not recurse)."""
    stack: list = [(body, 1, None)]  # (value, depth, the top-level field it is under)
    while stack:
        v, depth, field = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    where = f"'{field}'" if field else "a field name"
                    raise bad(field, f"{where} contains a lone UTF-16 surrogate, which is not "
                                     "valid Unicode") from None
            continue
        if depth > MAX_DEPTH and isinstance(v, (dict, list)):
            raise ApiError(400, f"request body is nested too deeply (limit {MAX_DEPTH})")
        if isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, depth, field))
                stack.append((x, depth + 1, field or k))
        elif isinstance(v, list):
            stack.extend((x, depth + 1, field) for x in v)


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
    if kind == "num" and not (_is_num(v) and (isinstance(v, int) or math.isfinite(v))):
        raise bad(key, f"'{key}' must be a finite number, got {brief(v)}")
    if kind == "bool" and not isinstance(v, bool):
        raise bad(key, f"'{key}' must be a boolean, got {type(v).__name__}")
    if kind == "str" and not isinstance(v, str):
        raise bad(key, f"'{key}' must be a string, got {type(v).__name__}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(key, f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {brief(v)}")
    if hi is not None and v > hi:
        raise bad(key, f"'{key}' must be <= {hi}, got {brief(v)}")
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
    structured_param: str | None = None  # the field the output's constraint came from
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    tokens_as_ids: bool = False          # logprobs name tokens "token_id:N"
    continuous_usage: bool = False       # a stream's every chunk carries the usage so far
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens
    add_generation_prompt: bool = True   # chat: the template opens the assistant's turn
    continue_final_message: bool = False  # chat: the last (assistant) message is continued
    echo: bool = False        # completions: each choice opens with its prompt (and logprobs)
    echo_only: bool = False   # echo with max_tokens 0: the prompt alone, nothing generated


def _token_ids(body: dict, key: str, vocab_size: int, limit: int) -> list[int] | None:
    ids = body.get(key)
    if ids is None:
        return None
    if not isinstance(ids, list) or len(ids) > limit or not all(_is_int(t) for t in ids):
        raise bad(key, f"'{key}' must be a list of at most {limit} integers")
    if any(not 0 <= t < vocab_size for t in ids):
        raise bad(key, f"'{key}' token ids must be in [0, {vocab_size})")
    return ids


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's form: {"token id": bias}, biases in [-100, 100]."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} "
                                "token ids (as strings) to biases")
    out = {}
    for k, v in lb.items():
        if not re.fullmatch(r"[0-9]{1,10}", k) or not int(k) < vocab_size:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab_size}),"
                                    f" got {brief(k)}")
        if not (_is_num(v) and -100 <= v <= 100):  # NaN and infinities fail here too
            raise bad("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], "
                                    f"got {brief(v)}")
        out[int(k)] = float(v)
    return out


def _unsupported(body: dict) -> None:
    for key, allowed in UNSUPPORTED.items():
        if key in body:
            try:
                ok = allowed(body[key])
            except TypeError:  # an unhashable value
                ok = False
            if not ok:
                raise bad(key, f"'{key}' is not supported by this server")


def _constraint(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output's constraint from response_format, structured_outputs or a guided_*
    field (at most one of them), and that field's name; the grammar is compiled later,
    against the model's tokenizer (app.py)."""
    given = [k for k in ("response_format", "structured_outputs", *GUIDED)
             if body.get(k) is not None and body.get(k) != {"type": "text"}]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad(given[1], f"give one output constraint, not {' and '.join(given)}")
    key, v = given[0], body[given[0]]
    if key == "response_format":
        kind = v.get("type") if isinstance(v, dict) else None
        if kind == "json_object":
            fields = {"json_object": True}
        elif kind == "json_schema":
            js = v.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise bad(key, "'response_format.json_schema' must be an object whose "
                               "'schema' is a JSON schema object")
            fields = {"json": js.get("schema", {})}
        else:
            raise bad(key, "'response_format.type' must be 'text', 'json_object' or "
                           f"'json_schema', got {brief(kind)}")
    elif key == "structured_outputs":
        if not isinstance(v, dict) or any(k not in STRUCTURED_FIELDS for k in v):
            raise bad(key, f"'structured_outputs' must be an object with one of "
                           f"{', '.join(STRUCTURED_FIELDS)}")
        fields = {k: x for k, x in v.items() if x is not None and x is not False}
    else:
        fields = {GUIDED[key]: v}
    try:
        return StructuredOutputsParams(**fields), key
    except StructuredOutputError as e:
        raise bad(key, f"'{key}': {e}") from None


def _sampling(body: dict, max_tokens, logprobs, vocab_size: int,
              structured: StructuredOutputsParams | None = None,
              echo_logprobs: int | None = None) -> SamplingParams:
    """echo_logprobs: the prompt's logprobs a completions echo needs (at least that many
    top ones; vLLM's)."""
    _unsupported(body)
    prompt_logprobs = _get(body, "prompt_logprobs", "int", None, 0, MAX_LOGPROBS)
    if prompt_logprobs is not None and _get(body, "stream", "bool", False):
        raise bad("prompt_logprobs", "'prompt_logprobs' is not supported with 'stream': "
                                     "true (a completions 'echo' streams them)")
    if echo_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, echo_logprobs)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or len(stop) > MAX_STOP
                or not all(isinstance(s, str) and s for s in stop)):
            raise bad("stop", f"'stop' must be a non-empty string or a list of at most "
                              f"{MAX_STOP} non-empty strings")
    stop_ids = _token_ids(body, "stop_token_ids", vocab_size, MAX_STOP_TOKEN_IDS)
    allowed = _token_ids(body, "allowed_token_ids", vocab_size, vocab_size)
    if allowed == []:
        raise bad("allowed_token_ids", "'allowed_token_ids' must not be empty")
    bad_words = body.get("bad_words")
    if bad_words is not None and (
            not isinstance(bad_words, list) or len(bad_words) > MAX_BAD_WORDS
            or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS
                       for w in bad_words)):
        raise bad("bad_words", f"'bad_words' must be a list of at most {MAX_BAD_WORDS} "
                               f"words of 1 to {MAX_BAD_WORD_CHARS} characters")
    seed = _get(body, "seed", "int")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad("seed", f"'seed' must be in [0, 2^63), got {brief(seed)}")
    top_k = _get(body, "top_k", "int", -1, -1)
    if top_k >= vocab_size:  # keeps every token: the same as no top-k
        top_k = -1
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", "num", 1.0, 0.0, 2.0)),
            top_p=float(_get(body, "top_p", "num", 1.0, 0.0, 1.0, lo_open=True)),
            top_k=top_k, min_p=float(_get(body, "min_p", "num", 0.0, 0.0, 1.0)),
            seed=seed, stop=stop, stop_token_ids=stop_ids,
            ignore_eos=_get(body, "ignore_eos", "bool", False),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", "bool", False),
            skip_special_tokens=_get(body, "skip_special_tokens", "bool", True),
            logprobs=logprobs,
            min_tokens=min(_get(body, "min_tokens", "int", 0, 0), max_tokens),
            presence_penalty=float(_get(body, "presence_penalty", "num", 0.0, -2.0, 2.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", "num", 0.0, -2.0, 2.0)),
            repetition_penalty=float(_get(body, "repetition_penalty", "num", 1.0, 0.0, 10.0,
                                          lo_open=True)),
            logit_bias=_logit_bias(body, vocab_size), structured_outputs=structured,
            prompt_logprobs=prompt_logprobs, allowed_token_ids=allowed,
            bad_words=bad_words or None)
    except SamplingError as e:  # what the checks above let through (max_tokens >= 2^31)
        raise bad(None, str(e)) from None


def with_sampling_defaults(body: dict, defaults: dict) -> dict:
    """The body with the model's sampling defaults (ModelBundle.sampling_defaults: its
    generation_config.json) in the fields it leaves unset or null, as vLLM's
    --generation-config auto does."""
    unset = {k: v for k, v in defaults.items() if body.get(k) is None}
    return {**body, **unset} if unset else body


def _common(body: dict) -> tuple[int, bool, bool, bool]:
    """n, stream, stream_options' include_usage and (with it) vLLM's
    continuous_usage_stats."""
    n = _get(body, "n", "int", 1, 1, MAX_N)
    stream = _get(body, "stream", "bool", False)
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "'stream_options' must be an object")
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed with 'stream': true")
        include_usage = _get(opts, "include_usage", "bool", False)
        continuous = include_usage and _get(opts, "continuous_usage_stats", "bool", False)
    return n, stream, include_usage, continuous


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
    n, stream, include_usage, continuous = _common(body)
    # echo: the prompt leads each choice's text, and its tokens' logprobs the logprobs
    # (lm-eval's loglikelihood: echo, logprobs 1, max_tokens 0 or 1)
    echo = _get(body, "echo", "bool", False)
    max_tokens = _get(body, "max_tokens", "int", 16, 0 if echo else 1, INT32_MAX)
    logprobs = _get(body, "logprobs", "int", None, 0, MAX_LOGPROBS)
    for key in ("tools", "tool_choice"):
        if body.get(key) not in (None, [], "none"):
            raise bad(key, f"'{key}' is a chat completions field")
    structured, source = _constraint(body)
    if echo and max_tokens == 0 and structured is not None:
        raise bad(source, f"'{source}' constrains generated text; 'max_tokens' 0 generates none")
    params = _sampling(body, max(max_tokens, 1), logprobs, vocab_size, structured,
                       echo_logprobs=logprobs if echo else None)
    return ParsedRequest(prompts, params, n, stream, include_usage,
                         "max_tokens" in body and body["max_tokens"] is not None, logprobs,
                         structured_param=source, continuous_usage=continuous,
                         echo=echo, echo_only=echo and max_tokens == 0,
                         **_prompt_and_logprob_extras(body))


def _prompt_and_logprob_extras(body: dict) -> dict:
    """vLLM's return_tokens_as_token_ids and truncate_prompt_tokens (-1: to the
    context's length, as vLLM)."""
    k = _get(body, "truncate_prompt_tokens", "int", None, -1, INT32_MAX)
    if k == 0:
        raise bad("truncate_prompt_tokens", "'truncate_prompt_tokens' must be >= 1 or -1")
    return {"tokens_as_ids": _get(body, "return_tokens_as_token_ids", "bool", False),
            "truncate_prompt_tokens": k}


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    return [_message_text(i, m) for i, m in enumerate(msgs)]


def _message_text(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}]", f"messages[{i}] must be an object")
    role = m.get("role")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of system, user, "
                                         f"assistant, developer, tool; got {brief(role)}")
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
    out = {"role": "system" if role == "developer" else role, "content": content}
    if role == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _message_tool_calls(i, m["tool_calls"])
    if role == "assistant" and m.get("reasoning_content") is not None:
        # an earlier turn's thinking, as the server returned it (Qwen3's template reads it)
        if not isinstance(m["reasoning_content"], str):
            raise bad(f"messages[{i}].reasoning_content",
                      f"messages[{i}].reasoning_content must be a string")
        out["reasoning_content"] = m["reasoning_content"]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"messages[{i}].{key}", f"messages[{i}].{key} must be a string")
                out[key] = m[key]
    return out


def _message_tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's earlier calls, their arguments as objects where they parse
    (chat templates write them with `| tojson`, as transformers hands them over)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(where, f"{where} must be a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), (str, dict))):
            raise bad(where, f"{where} must hold {{'type': 'function', 'function': {{'name',"
                             " 'arguments'}}}} objects")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # kept as the text the client sent
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else None,
                    "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


# chat_template_kwargs: variables for the chat template (vLLM's field), not the ones the
# server sets, the template functions (ours, jinja's) or jinja's own names
_TEMPLATE_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_TEMPLATE_SET = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                 "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler",
                 "joiner", "namespace", "loop", "self", "super", "caller", "varargs",
                 "kwargs")
MAX_TEMPLATE_KWARGS = 32


def _template_kwargs(body: dict) -> dict:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or len(kw) > MAX_TEMPLATE_KWARGS:
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object of at "
                                          f"most {MAX_TEMPLATE_KWARGS} template variables")
    for key in kw:
        if not _TEMPLATE_VAR.fullmatch(key):
            raise bad("chat_template_kwargs", f"chat_template_kwargs key {brief(key)} is not "
                                              "a template variable name")
        if key in _TEMPLATE_SET:
            raise bad("chat_template_kwargs", f"chat_template_kwargs cannot set {key!r}: the "
                                              "server or the template language defines it")
    return kw


def parse_chat(body: dict, vocab_size: int) -> tuple[list[dict], ParsedRequest, Any]:
    """(messages, the request, its tools.ToolRequest or None)."""
    messages = _messages(body)
    n, stream, include_usage, continuous = _common(body)
    max_tokens = _get(body, "max_completion_tokens", "int", None, 1, INT32_MAX)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", "int", None, 1, INT32_MAX)
    given = max_tokens is not None
    want_lp = _get(body, "logprobs", "bool", False)
    top = _get(body, "top_logprobs", "int", None, 0, MAX_LOGPROBS)
    if top is not None and not want_lp:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
    logprobs = (top or 0) if want_lp else None
    structured, source = _constraint(body)
    treq = parse_tools(body)
    forced = treq.constraint() if treq is not None else None
    if forced is not None:
        if structured is not None:
            raise bad(source, f"'{source}' cannot be combined with a 'tool_choice' that "
                              "requires a call")
        structured, source = forced, "tools"
    params = _sampling(body, max_tokens or 1, logprobs, vocab_size, structured)
    opening, continued = _chat_turn(body, messages)
    return messages, ParsedRequest([], params, n, stream, include_usage, given, logprobs,
                                   structured_param=source,
                                   chat_template_kwargs=_template_kwargs(body),
                                   add_generation_prompt=opening,
                                   continue_final_message=continued,
                                   continuous_usage=continuous,
                                   **_prompt_and_logprob_extras(body)), treq


def _chat_turn(body: dict, messages: list[dict]) -> tuple[bool, bool]:
    """vLLM's add_generation_prompt (default true) and continue_final_message (default
    false: the model writes on from the last message, an assistant's prefix)."""
    continued = _get(body, "continue_final_message", "bool", False)
    opening = _get(body, "add_generation_prompt", "bool", not continued)
    if continued and opening:
        raise bad("continue_final_message", "'continue_final_message' and "
                                            "'add_generation_prompt' cannot both be true")
    if continued and messages[-1]["role"] != "assistant":
        raise bad("continue_final_message", "'continue_final_message' needs the last message "
                                            "to be the assistant's")
    return opening, continued


@dataclasses.dataclass
class TokenizeRequest:
    """POST /tokenize, as vLLM's: a prompt, or chat messages rendered as the chat endpoint
    renders them (tools and chat_template_kwargs included)."""
    prompt: str | None
    messages: list[dict] | None
    tools: Any = None                      # tools.ToolRequest, with messages
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True
    return_token_strs: bool = False


def parse_tokenize(body: dict) -> TokenizeRequest:
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad("prompt", "give either 'prompt' (a string) or 'messages' (one of them)")
    strs = _get(body, "return_token_strs", "bool", False)
    if has_prompt:
        return TokenizeRequest(_get(body, "prompt", "str"), None,
                               add_special_tokens=_get(body, "add_special_tokens", "bool", True),
                               return_token_strs=strs)
    messages = _messages(body)
    opening, continued = _chat_turn(body, messages)
    # add_special_tokens: by default the chat endpoint's (a BOS the template left out)
    return TokenizeRequest(None, messages, parse_tools(body), _template_kwargs(body),
                           opening, continued,
                           _get(body, "add_special_tokens", "bool", True), strs)


def parse_detokenize(body: dict, vocab_size: int) -> list[int]:
    """POST /detokenize's 'tokens'."""
    if body.get("tokens") is None:
        raise bad("tokens", "'tokens' (a list of token ids) is required")
    return _token_ids(body, "tokens", vocab_size, MAX_DETOKENIZE_IDS) or []


MAX_DETOKENIZE_IDS = 1 << 20
