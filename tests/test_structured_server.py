"""Structured outputs and tool calling over HTTP, on the embedded SmolLM2 model, spoken to
by the official openai client: constrained outputs obey their constraint, streamed too;
tool calls come back as tool_calls; the model's sampling defaults reach requests that
leave them unset (top_k 1 here); bad constraints are a 400 that reaches no engine.
Reasoning models' think blocks: tests/test_reasoning_server.py."""
import json
import re
import urllib.error
import urllib.request

import pytest
from test_server import MODEL, ServerThread

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 10},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    s = ServerThread(smollm2, sampling_defaults={"top_k": 1})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0.7, seed=1,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "forecast", "schema": CITY}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_streamed_completion_under_a_regex_and_a_choice(client):
    stream = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20,
                                       temperature=1.0, seed=3, stream=True,
                                       extra_body={"guided_regex": r"\d{3}-\d{4}"})
    chunks = list(stream)
    assert re.fullmatch(r"\d{3}-\d{4}", "".join(c.choices[0].text for c in chunks))
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, n=2,
                                  temperature=1.0, seed=5, extra_body={
                                      "structured_outputs": {"choice": ["blue", "grey"]}})
    assert {c.text for c in r.choices} <= {"blue", "grey"}


def test_named_tool_choice_returns_arguments_that_validate(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0.7, seed=2,
        tools=[WEATHER, TIME], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_required_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0.7, seed=4,
        tools=[WEATHER, TIME], tool_choice="required", stream=True)
    calls, reasons = {}, []
    for chunk in stream:  # assembled as the openai client's users do: by index
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and calls
    schemas = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_auto_parses_the_models_hermes_call(client):
    """auto: the model's own text is parsed (a regex makes this small model write a call)."""
    call = (r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}'
            r'\n</tool_call>')
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, tools=[WEATHER, TIME],
              extra_body={"guided_regex": "Checking\\." + call})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Checking."
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_time" and json.loads(tc.function.arguments)["zone"] in (
        "UTC", "CET")
    content, names = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            names += [t.function.name for t in c.delta.tool_calls or []]
    assert content == "Checking." and names == ["get_time"]


def test_requests_that_leave_sampling_unset_get_the_models_defaults(client):
    """The server's sampling defaults (a generation_config.json's; top_k 1 here: greedy
    whatever the temperature) fill what a request leaves unset; what it sets wins."""
    kw = dict(model=MODEL, messages=ASK, max_tokens=8)
    greedy = client.chat.completions.create(**kw, temperature=0).choices[0].message.content
    for _ in range(2):  # temperature 1, no seed: greedy only through the default top_k
        assert client.chat.completions.create(**kw).choices[0].message.content == greedy
    wide = {client.chat.completions.create(**kw, extra_body={"top_k": 50}, seed=s).choices[0]
            .message.content for s in range(4)}
    assert len(wide) > 1


@pytest.mark.parametrize("path, extra, param, needle", [
    ("chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "cannot set 'messages'"),
    ("chat/completions", {"chat_template_kwargs": ["enable_thinking"]},
     "chat_template_kwargs", "must be an object"),
    ("completions", {"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ("completions", {"structured_outputs": {"grammar": "start: nowhere"}},
     "structured_outputs", "nowhere"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "response_format", "bogus"),
    ("completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ("completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex",
     "one output constraint"),
    ("completions", {"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "one of"),
    ("chat/completions", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice", "get_time"),
    ("chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "bogus"}}}], "tool_choice": "required"},
     "tools", "bogus"),
])
def test_bad_constraints_are_a_400_and_reach_no_engine(server, path, extra, param, needle):
    finished = dict(server.engine.stats.finished)
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"prompt": "hi"} if path == "completions" else {"messages": ASK})
    req = urllib.request.Request(f"{server.url}/v1/{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400
    err = json.loads(e.value.read())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"]
    assert server.idle() and not server.engine.requests
    assert server.engine.stats.finished == finished
