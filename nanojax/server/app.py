"""The aiohttp application: OpenAI completions and chat completions, SSE streaming,
/v1/models, vLLM's /tokenize, /detokenize and /version, /health and Prometheus /metrics.

Every request runs as one or more engine requests (n choices x prompts); when the client
goes away, the handler is cancelled and each of its engine requests is aborted, which
frees its KV pages at the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import Callable

from aiohttp import web

from nanojax.engine.async_engine import AsyncLLMEngine, EngineDeadError
from nanojax.engine.llm_engine import RequestError
from nanojax.engine.sampling import SamplingError
from nanojax.engine.structured import StructuredOutputError
from nanojax.errors import NanojaxError
from nanojax.server import reasoning, tools
from nanojax.server.metrics import ServerMetrics
from nanojax.server.protocol import (ApiError, ParsedRequest, bad, brief, parse_chat,
                                     parse_completion, parse_detokenize, parse_json,
                                     parse_tokenize, with_sampling_defaults)

log = logging.getLogger("nanojax.server")

ENGINE_KEY = web.AppKey("engine", AsyncLLMEngine)
STATE_KEY = web.AppKey("state", dict)


def _json(data, status=200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d))


def _as_api_error(e: Exception) -> ApiError | None:
    """The client-facing error for an exception a request ended with; None: a bug."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (RequestError, SamplingError)):
        return ApiError(400, str(e))
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), "service_unavailable")
    if isinstance(e, RequestFailed):
        return ApiError(500, str(e), "internal_error")
    return None


@web.middleware
async def error_middleware(request: web.Request, handler):
    metrics = request.app[STATE_KEY]["metrics"]
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(e.status, "invalid_request_error")
        metrics.refused(e.status)
        msg = {404: f"route {request.method} {request.path} not found",
               405: f"method {request.method} not allowed on {request.path}",
               413: f"request body too large (limit {request.app[STATE_KEY]['max_body']} "
                    "bytes)"}.get(e.status, e.reason)
        return _json(ApiError(e.status, msg, kind).body(), e.status)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        err = _as_api_error(e)
        if err is None:
            log.exception("internal error on %s %s", request.method, request.path)
            err = ApiError(500, "internal server error", "internal_error")
        metrics.refused(err.status)
        return _json(err.body(), err.status)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[STATE_KEY]["api_key"]
    if key and (request.path.startswith("/v1/") or request.path in PROTECTED):
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            raise ApiError(401, "invalid or missing API key", "authentication_error",
                           code="invalid_api_key")
    return await handler(request)


PROTECTED = ("/server_info", "/tokenize", "/detokenize")  # beside /v1/: need the API key


async def _read_json(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    return parse_json(raw)


def _check_model(request: web.Request, body: dict) -> str:
    name = request.app[STATE_KEY]["model_name"]
    model = body.get("model", name)
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model != name:
        raise ApiError(404, f"the model {brief(model)} does not exist; this server serves "
                            f"'{name}'", "not_found_error", param="model",
                       code="model_not_found")
    return model


class RequestFailed(Exception):
    """The engine failed one request (and only it): a 500 for that request."""


class _Choices:
    """Runs n x len(prompts) engine requests and merges their outputs in arrival order."""

    def __init__(self, app, prompt_ids: list[list[int]], parsed: ParsedRequest, base_id):
        self.engine: AsyncLLMEngine = app[ENGINE_KEY]
        self.state = app[STATE_KEY]
        self.metrics: ServerMetrics = self.state["metrics"]
        self.prompt_ids, self.parsed, self.base_id = prompt_ids, parsed, base_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.completion_tokens = 0  # streamed so far (deltas()), and per choice index
        self.tokens_of: dict[int, int] = {}

    def start(self):
        p = self.parsed
        # a stream reads what is new in each output; a whole response only the last
        kind = "delta" if p.stream else "final_only"
        for pi, ids in enumerate(self.prompt_ids):
            for k in range(p.n):
                params = dataclasses.replace(p.params, output_kind=kind)
                if p.n > 1:  # distinct samples: derive a seed per choice
                    seed = None if params.seed is None else (params.seed + k) % 2**63
                    params = dataclasses.replace(params, seed=seed)
                idx = pi * p.n + k
                self.metrics.prompt_tokens.inc(len(ids))
                self.tasks.append(asyncio.create_task(self._pump(idx, ids, params)))
        self.state["admitted"] += len(self.tasks)  # counted at once: no other handler
        return self                                 # runs before the tasks register

    async def _pump(self, idx, ids, params):
        try:
            await self._pump_outputs(idx, ids, params)
        finally:
            self.state["admitted"] -= 1

    async def _pump_outputs(self, idx, ids, params):
        t0 = last = time.monotonic()
        first = True
        try:
            async for out in self.engine.generate(ids, params, f"{self.base_id}-{idx}"):
                now = time.monotonic()
                n_new = len(out.delta_token_ids)
                if n_new:
                    self.metrics.generation_tokens.inc(n_new)
                    gaps = n_new
                    if first:  # a whole response's one output: the engine's first token
                        ttft = (out.first_token_latency if n_new > 1 and
                                out.first_token_latency is not None else now - t0)
                        self.metrics.ttft.observe(ttft)
                        first, last, gaps = False, t0 + ttft, n_new - 1
                    for _ in range(gaps):
                        self.metrics.itl.observe((now - last) / gaps)
                    last = now
                if out.finished:
                    if out.finish_reason == "error":
                        raise RequestFailed(f"the engine failed this request: "
                                            f"{out.outputs[0].stop_reason}")
                    self.metrics.e2e.observe(now - t0)
                    self.metrics.finished(out.finish_reason)
                await self.queue.put((idx, out))
        except Exception as e:
            await self.queue.put((idx, e))
            return
        await self.queue.put((idx, None))

    async def finals(self) -> dict:
        """Choice index -> its finished RequestOutput."""
        return {idx: out async for idx, out in self.stream() if out.finished}

    async def deltas(self):
        """(index, output, log-probs of the tokens new in this output); counts the
        completion tokens of finished choices in self.completion_tokens."""
        async for idx, out in self.stream():  # the engine's outputs are deltas here
            new = 0 if self.parsed.echo_only else len(out.delta_token_ids)  # (not returned)
            self.completion_tokens += new
            self.tokens_of[idx] = self.tokens_of.get(idx, 0) + new
            yield idx, out, out.outputs[0].logprobs

    def usage_of(self, idx: int) -> dict:
        """One choice's usage so far (continuous_usage_stats: per choice, as vLLM's)."""
        return _usage([self.prompt_ids[idx // self.parsed.n]], self.tokens_of.get(idx, 0))

    async def stream(self):
        remaining = len(self.tasks)
        try:
            while remaining:
                idx, item = await self.queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                yield idx, item
        finally:
            for t in self.tasks:
                if not t.done():
                    t.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)


def _prepare(request: web.Request, prompts: list, parsed: ParsedRequest) -> list[list[int]]:
    eng: AsyncLLMEngine = request.app[ENGINE_KEY]
    state = request.app[STATE_KEY]
    if not eng.is_alive:
        raise ApiError(503, "the engine is not running", "service_unavailable")
    limit = state["max_waiting"]
    want = len(prompts) * parsed.n  # engine requests this one becomes, checked before any
    if limit is not None:           # is tokenized or queued
        if want > max(limit, 1):  # can never fit (one alone is only "busy")
            raise ApiError(400, f"this request asks for {want} completions (prompts x n); "
                                f"the server queues at most {limit} at a time", param="n")
        waiting = max(eng.num_pending, state["admitted"]) - eng.engine.num_running
        if waiting + want > limit:
            raise ApiError(503, f"server busy: {waiting} requests are waiting and this one "
                                f"adds {want} (limit {limit})", "service_unavailable")
    max_len = eng.engine.max_model_len
    out = []
    for p in prompts:
        try:
            ids = eng.encode(p)
        except NanojaxError as e:
            raise ApiError(400, str(e), param="prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        keep = parsed.truncate_prompt_tokens
        if keep is not None and keep > max_len:
            raise ApiError(400, f"'truncate_prompt_tokens' ({keep}) is past the model's "
                                f"maximum context length ({max_len})",
                           param="truncate_prompt_tokens")
        if keep is not None:  # the prompt's last tokens (-1: as many as the context holds)
            ids = ids[-(max_len if keep == -1 else keep):]
        if not parsed.max_tokens_given:
            if parsed.echo_chat:  # chat default: whatever room the context leaves
                parsed.params.max_tokens = max(1, max_len - len(ids))
        if len(ids) + parsed.params.max_tokens > max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                                f"However, you requested {len(ids) + parsed.params.max_tokens}"
                                f" tokens ({len(ids)} in the prompt, "
                                f"{parsed.params.max_tokens} in the completion).",
                           param="max_tokens", code="context_length_exceeded")
        out.append(ids)
    return out


async def _check_constraint(request: web.Request, parsed: ParsedRequest) -> None:
    """A 400 naming the problem when the output's constraint does not compile (off the
    event loop: a big schema compiles for a while), so nothing bad reaches the engine."""
    spec = parsed.params.structured_outputs
    if spec is None:
        return
    engine = request.app[ENGINE_KEY].engine
    try:
        await asyncio.to_thread(lambda: engine.grammars.check(spec))
    except StructuredOutputError as e:
        what = ("a tool's parameters schema" if parsed.structured_param == "tools"
                else f"'{parsed.structured_param}'")
        raise bad(parsed.structured_param, f"{what} does not compile: {e}") from None


def _token_namer(tokenizer, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or vLLM's "token_id:N"
    (return_tokens_as_token_ids, for clients that must not re-tokenize)."""
    if as_ids:
        return lambda tid: f"token_id:{tid}"
    if tokenizer is None:
        return str
    return lambda tid: tokenizer.decode([tid], skip_special_tokens=False)


def _completion_logprobs(name, lps, offset0: int) -> dict | None:
    """OpenAI's completions logprobs of entries (CompletionOutput.logprobs'; a prompt's
    first token has None for its logprob and tops); offsets run on from offset0."""
    if lps is None:
        return None
    tokens = [name(e["token_id"]) for e in lps]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in lps],
            "top_logprobs": [None if e["top"] is None else {name(i): v for i, v in e["top"]}
                             for e in lps],
            "text_offset": offsets}


def _prompt_entries(prompt_ids: list[int], scored: list | None, k: int) -> list[dict]:
    """A prompt's tokens as logprob entries (RequestOutput.prompt_logprobs) with their k
    top ones (the request may have scored more: prompt_logprobs); the first, with nothing
    before it, has none."""
    none = {"logprob": None, "top": None}
    return [{"token_id": prompt_ids[0], **none}] + [
        {**e, "top": e["top"][:k]} if e is not None else {"token_id": t, **none}
        for t, e in zip(prompt_ids[1:], (scored or [None] * len(prompt_ids))[1:])]


def _vllm_prompt_logprobs(name, scored: list | None, k: int) -> list | None:
    """vLLM's prompt_logprobs field: per prompt token None (the first) or {token id:
    {logprob, rank, decoded_token}} for the token itself and the k top ones after it."""
    if scored is None:
        return None

    def entry(e):
        d = {str(e["token_id"]): {"logprob": e["logprob"], "rank": e["rank"],
                                  "decoded_token": name(e["token_id"])}}
        for rank, (i, v) in enumerate(e["top"][:k], 1):
            d.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": name(i)})
        return d

    return [None if e is None else entry(e) for e in scored]


def _prompt_text(tokenizer, prompt, ids: list[int], parsed: ParsedRequest) -> str:
    """The text a completions echo opens with: the prompt as sent, or as the tokens the
    model saw where it was token ids or truncated."""
    if isinstance(prompt, str) and parsed.truncate_prompt_tokens is None:
        return prompt
    if tokenizer is None:
        return ""
    return tokenizer.decode(ids, skip_special_tokens=parsed.params.skip_special_tokens)


def _chat_logprobs(name, lps) -> dict | None:
    if lps is None:
        return None

    def entry(tid, lp):
        s = name(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(e["token_id"], e["logprob"]),
                         "top_logprobs": [entry(i, v) for i, v in e["top"]]} for e in lps]}


def _envelope(rid, obj, created, model, choice_list, usage=None) -> dict:
    d = {"id": rid, "object": obj, "created": created, "model": model,
         "choices": choice_list}
    if usage is not None:
        d["usage"] = usage
    return d


def _usage(prompt_ids, completion_tokens: int) -> dict:
    p = sum(len(x) for x in prompt_ids)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens}


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, data) -> None:
    payload = data if isinstance(data, str) else json.dumps(data)
    await resp.write(f"data: {payload}\n\n".encode())


async def _stream_error(request: web.Request, resp: web.StreamResponse, e: Exception):
    """A request that fails after its stream began: an error event, then [DONE]."""
    err = _as_api_error(e)
    if err is None:
        log.exception("internal error while streaming %s", request.path)
        err = ApiError(500, "internal server error", "internal_error")
    request.app[STATE_KEY]["metrics"].refused(err.status)
    await _send(resp, err.body())
    return await _end_stream(resp, None)


async def _end_stream(resp: web.StreamResponse, usage_chunk: dict | None):
    if usage_chunk is not None:
        await _send(resp, usage_chunk)
    await _send(resp, "[DONE]")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    model = _check_model(request, body)
    eng: AsyncLLMEngine = request.app[ENGINE_KEY]
    parsed = parse_completion(with_sampling_defaults(body, request.app[STATE_KEY][
        "sampling_defaults"]), eng.engine.model_config.vocab_size)
    await _check_constraint(request, parsed)
    prompt_ids = _prepare(request, parsed.prompts, parsed)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choices = _Choices(request.app, prompt_ids, parsed, rid).start()
    name = _token_namer(eng.tokenizer, parsed.tokens_as_ids)
    echo = ([_prompt_text(eng.tokenizer, p, ids, parsed)
             for p, ids in zip(parsed.prompts, prompt_ids)] if parsed.echo else None)
    asked_prompt_lps = body.get("prompt_logprobs")  # (parse_completion checked it)

    def chunk(choice_list, usage=None):
        if usage is None and parsed.continuous_usage and choice_list:
            usage = choices.usage_of(choice_list[0]["index"])
        return _envelope(rid, "text_completion", created, model, choice_list, usage)

    def choice(idx, out, text, lps, first: bool, finished: bool, offset: int = 0) -> dict:
        """A choice (or a stream's chunk of it: first, and its text's offset): its text and
        logprobs, the echoed prompt's ahead of the first; with echo_only nothing generated
        is shown."""
        c = out.outputs[0]
        if parsed.echo_only:
            text, lps = "", ([] if lps is not None else None)
        if echo is not None and first:
            p = idx // parsed.n
            text = echo[p] + text
            if parsed.logprobs is not None:
                lps = (_prompt_entries(prompt_ids[p], out.prompt_logprobs, parsed.logprobs)
                       + (lps or []))
        d = {"index": idx, "text": text, "logprobs": _completion_logprobs(name, lps, offset),
             "finish_reason": ("length" if parsed.echo_only else c.finish_reason)
             if finished else None,
             "stop_reason": None if parsed.echo_only or not finished else c.stop_reason}
        if asked_prompt_lps is not None and first:
            d["prompt_logprobs"] = _vllm_prompt_logprobs(name, out.prompt_logprobs,
                                                         asked_prompt_lps)
        return d

    if parsed.stream:
        resp = await _sse(request)
        sent: dict[int, int] = {}  # text streamed so far per choice: offsets run on
        try:
            async for idx, out, lps in choices.deltas():
                first, offset = idx not in sent, sent.get(idx, 0)
                d = choice(idx, out, out.delta_text, lps, first, out.finished, offset)
                if d["text"] or out.finished or (out.delta_token_ids and not parsed.echo_only):
                    sent[idx] = offset + len(d["text"])
                    await _send(resp, chunk([d]))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:
            return await _stream_error(request, resp, e)
        return await _end_stream(resp, chunk([], _usage(prompt_ids, choices.completion_tokens))
                                 if parsed.include_usage else None)

    finals = await choices.finals()
    result = [choice(idx, finals[idx], finals[idx].text, finals[idx].outputs[0].logprobs,
                     True, True) for idx in sorted(finals)]
    usage = _usage(prompt_ids, 0 if parsed.echo_only
                   else sum(len(finals[i].token_ids) for i in finals))
    return _json(chunk(result, usage))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    model = _check_model(request, body)
    eng: AsyncLLMEngine = request.app[ENGINE_KEY]
    messages, parsed, treq = parse_chat(with_sampling_defaults(body, request.app[STATE_KEY][
        "sampling_defaults"]), eng.engine.model_config.vocab_size)
    if eng.tokenizer is None or not eng.tokenizer.chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    try:
        text = tools.render(eng.tokenizer, messages, treq, parsed.chat_template_kwargs,
                            parsed.add_generation_prompt, parsed.continue_final_message)
    except NanojaxError as e:
        raise ApiError(400, str(e), param="messages") from None
    parser = request.app[STATE_KEY]["reasoning_parser"]  # thinking split from the answer
    thinking_mode = reasoning.mode_for(
        parser, parsed.chat_template_kwargs,
        messages[-1]["content"] if parsed.continue_final_message else None)
    constraint = parsed.params.structured_outputs
    if thinking_mode == "implicit" and constraint is not None:  # constrained after thinking
        parsed.params = dataclasses.replace(parsed.params, structured_outputs=dataclasses.replace(
            constraint, think_end=reasoning.THINK_CLOSE))
    await _check_constraint(request, parsed)
    parsed.echo_chat = True  # max_tokens defaults to the room left in the context
    calls = treq if treq is not None and treq.choice != "none" else None
    fmt = tools.tool_format(eng.tokenizer.chat_template)
    prompt_ids = _prepare(request, [text], parsed)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    choices = _Choices(request.app, prompt_ids, parsed, rid).start()
    name = _token_namer(eng.tokenizer, parsed.tokens_as_ids)

    def chunk(obj, choice_list, usage=None):
        if usage is None and parsed.continuous_usage and choice_list:
            usage = choices.usage_of(choice_list[0]["index"])
        return _envelope(rid, obj, created, model, choice_list, usage)

    if parsed.stream:
        resp = await _sse(request)
        for idx in range(parsed.n):
            await _send(resp, chunk("chat.completion.chunk", [{
                "index": idx, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}]))
        streams = {i: tools.ToolCallStream(calls, fmt) for i in range(parsed.n)} if calls else {}
        thinking = ({i: reasoning.ReasoningStream(thinking_mode) for i in range(parsed.n)}
                    if parser else {})
        held_lps: dict[int, list] = {}  # logprobs of tokens whose text is not sent yet

        def as_deltas(idx, pieces) -> list[dict]:
            """(field, text) pieces of a choice's output -> its chunks' deltas: thinking as
            written, content through the choice's tool-call parser where it has one."""
            out = []
            for field, text in pieces:
                delta = ({field: text} if field == "reasoning_content" or idx not in streams
                         else streams[idx].push(text))
                if delta is not None:
                    out.append(delta)
            return out

        try:
            async for idx, out, lps in choices.deltas():
                c = out.outputs[0]
                if lps:
                    held_lps.setdefault(idx, []).extend(lps)
                if out.delta_text or out.delta_token_ids:
                    pieces = (thinking[idx].push(out.delta_text) if idx in thinking
                              else [("content", out.delta_text)])
                    for delta in as_deltas(idx, pieces):
                        await _send(resp, chunk("chat.completion.chunk", [{
                            "index": idx, "delta": delta, "finish_reason": None,
                            "logprobs": _chat_logprobs(name, held_lps.pop(idx, None))}]))
                if out.finished:
                    reason = c.finish_reason
                    last = as_deltas(idx, thinking[idx].finish()) if idx in thinking else []
                    if idx in streams:
                        tail, reason = streams[idx].finish(reason)
                        last += tail
                    for delta in last:
                        await _send(resp, chunk("chat.completion.chunk", [{
                            "index": idx, "delta": delta, "finish_reason": None,
                            "logprobs": _chat_logprobs(name, held_lps.pop(idx, None))}]))
                    await _send(resp, chunk("chat.completion.chunk", [{
                        "index": idx, "delta": {},
                        "logprobs": _chat_logprobs(name, held_lps.pop(idx, None)),
                        "finish_reason": reason, "stop_reason": c.stop_reason}]))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:
            return await _stream_error(request, resp, e)
        return await _end_stream(resp, chunk("chat.completion.chunk", [], _usage(
            prompt_ids, choices.completion_tokens)) if parsed.include_usage else None)

    finals = await choices.finals()
    result = []
    for i in sorted(finals):
        c = finals[i].outputs[0]
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if parser:
            message["reasoning_content"], message["content"] = reasoning.split(thinking_mode,
                                                                               c.text)
        if calls is not None and message["content"] is not None:
            content, found = tools.parse_calls(calls, fmt, message["content"])
            message["content"], reason = content, tools.finish_reason(found, reason)
            if found:
                message["tool_calls"] = tools.openai_calls(found)
        result.append({"index": i, "message": message,
                       "logprobs": _chat_logprobs(name, c.logprobs), "finish_reason": reason,
                       "stop_reason": c.stop_reason})
    usage = _usage(prompt_ids, sum(len(finals[i].token_ids) for i in finals))
    response = chunk("chat.completion", result, usage)
    if finals and parsed.params.prompt_logprobs is not None:  # vLLM's: one rendered prompt
        response["prompt_logprobs"] = _vllm_prompt_logprobs(
            name, finals[min(finals)].prompt_logprobs, parsed.params.prompt_logprobs)
    return _json(response)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return _json({"object": "list", "data": [{
        "id": state["model_name"], "object": "model", "created": state["created"],
        "owned_by": "nanojax", "max_model_len": request.app[ENGINE_KEY].engine.max_model_len}]})


def _tokenizer(request: web.Request):
    tok = request.app[ENGINE_KEY].tokenizer
    if tok is None:
        raise ApiError(400, "this model has no tokenizer: it takes and gives token ids")
    return tok


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: the ids the completions or chat endpoint would feed the model."""
    body = await _read_json(request)
    _check_model(request, body)
    req = parse_tokenize(body)
    tok = _tokenizer(request)
    if req.messages is not None:
        if not tok.chat_template:
            raise ApiError(400, "this model has no chat template; tokenize a 'prompt'",
                           param="messages")
        try:
            text = tools.render(tok, req.messages, req.tools, req.chat_template_kwargs,
                                req.add_generation_prompt, req.continue_final_message)
        except NanojaxError as e:
            raise ApiError(400, str(e), param="messages") from None
    else:
        text = req.prompt
    try:
        ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    except NanojaxError as e:
        raise ApiError(400, str(e), param="prompt") from None
    return _json({"count": len(ids), "tokens": ids,
                  "max_model_len": request.app[ENGINE_KEY].engine.max_model_len,
                  "token_strs": [tok.id_to_token(t) for t in ids] if req.return_token_strs
                  else None})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: token ids to text, special tokens kept."""
    body = await _read_json(request)
    _check_model(request, body)
    ids = parse_detokenize(body, request.app[ENGINE_KEY].engine.model_config.vocab_size)
    return _json({"prompt": _tokenizer(request).decode(ids, skip_special_tokens=False)})


async def version(request: web.Request) -> web.Response:
    from nanojax import __version__
    return _json({"version": __version__})


async def get_server_info(request: web.Request) -> web.Response:
    """What this server runs (as SGLang's /get_server_info): the model, the waiting limit,
    and the run record `nanojax serve` passed in (its command, environment with XLA flags,
    engine config with the kernels, plan), so a benchmark's result names what it measured."""
    state = request.app[STATE_KEY]
    return _json({"model": state["model_name"], "max_waiting": state["max_waiting"],
                  "max_model_len": request.app[ENGINE_KEY].engine.max_model_len,
                  **state["server_info"]})


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE_KEY].is_alive:
        return _json({"status": "ok"})
    return _json(ApiError(503, "the engine is not running", "service_unavailable").body(), 503)


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST
    body = request.app[STATE_KEY]["metrics"].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _watch_engine(app: web.Application):
    """Notices an engine that died (its loop raised): logs it once and calls
    on_engine_death, which in `nanojax serve` shuts the process down with status 1."""
    async def watch():
        eng = app[ENGINE_KEY]
        while eng.error is None:
            await asyncio.sleep(ENGINE_WATCH_S)
        log.error("the engine failed: %s: %s; /health answers 503",
                  type(eng.error).__name__, eng.error)
        callback = app[STATE_KEY]["on_engine_death"]
        if callback is not None:
            callback(eng.error)

    task = asyncio.create_task(watch())
    yield
    task.cancel()


ENGINE_WATCH_S = 0.2


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_body: int = 1 << 20, max_waiting: int | None = 256,
              on_engine_death: Callable[[BaseException], None] | None = None,
              server_info: dict | None = None,
              reasoning_parser: str | None = None,
              sampling_defaults: dict | None = None) -> web.Application:
    """max_waiting: engine requests (prompts x n per HTTP request) allowed to wait; None:
    no limit. on_engine_death: called once, on the event loop, if the engine dies.
    server_info: what GET /server_info adds to the model's name and limits.
    reasoning_parser: split chat outputs' thinking into reasoning_content (reasoning.py's
    PARSERS; None: no split). sampling_defaults: what requests that leave temperature,
    top_p, top_k, min_p, repetition_penalty unset get (the model's generation_config.json)."""
    if reasoning_parser is not None and reasoning_parser not in reasoning.PARSERS:
        raise ValueError(f"reasoning parser {reasoning_parser!r}: one of {reasoning.PARSERS}")
    app = web.Application(middlewares=[error_middleware, auth_middleware],
                          client_max_size=max_body)
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = {"model_name": model_name, "api_key": api_key, "max_body": max_body,
                      "max_waiting": max_waiting, "created": int(time.time()),
                      "metrics": ServerMetrics(engine, model_name), "admitted": 0,
                      "on_engine_death": on_engine_death, "server_info": server_info or {},
                      "reasoning_parser": reasoning_parser,
                      "sampling_defaults": dict(sampling_defaults or {})}
    app.cleanup_ctx.append(_watch_engine)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", get_server_info)
    app.router.add_get("/metrics", metrics)
    return app
