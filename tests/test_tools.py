"""Tool calling without a model: tools and tool_choice checked, the prompt rendered through
a tool-aware template, the model's text parsed into calls, whole and streamed."""
import json

import pytest

from nanojax.server import tools
from nanojax.server.protocol import ApiError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def treq(choice="auto"):
    return tools.parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice})


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tools_are_a_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        tools.parse_tools(body)
    assert e.value.status == 400 and e.value.param == param


def test_choices_and_their_grammars():
    assert tools.parse_tools({"tools": []}) is None
    assert treq().choice == "auto" and treq().constraint() is None
    assert treq("none").constraint() is None
    named = treq({"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint().json == WEATHER["function"]["parameters"]
    required = treq("required").constraint().json
    assert required["type"] == "array" and required["minItems"] == 1
    names = [alt["properties"]["name"]["const"] for alt in required["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]


def test_parse_hermes_llama3_required_and_named():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = tools.parse_calls(treq(), "hermes", text)
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    content, calls = tools.parse_calls(
        treq(), "llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content is None and json.loads(calls[0]["arguments"]) == {"city": "Rome"}
    assert tools.parse_calls(treq(), "hermes", "Just text.") == ("Just text.", [])
    assert tools.parse_calls(treq(), "hermes", "<tool_call>{broken") == (
        "<tool_call>{broken", [])
    content, calls = tools.parse_calls(treq("required"), "hermes",
                                       '[{"name": "get_time", "parameters": {}}]')
    assert content is None and calls == [{"name": "get_time", "arguments": "{}"}]
    named = treq({"type": "function", "function": {"name": "get_weather"}})
    assert tools.parse_calls(named, "hermes", '{"city": "Oslo"}') == (
        None, [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}])
    # parallel_tool_calls false: the first call only, and a required call's grammar
    # allows one
    one = tools.parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    content, calls = tools.parse_calls(one, "hermes", text)
    assert content == "Let me check." and [c["name"] for c in calls] == ["get_weather"]
    single = tools.parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required",
                                "parallel_tool_calls": False})
    assert single.constraint().json["maxItems"] == 1
    assert "maxItems" not in treq("required").constraint().json
    stream = tools.ToolCallStream(one, "hermes")
    deltas, _ = _run_stream(stream, [text[:20], text[20:]])
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == [
        "get_weather"]
    broken_second = text.replace('"get_time", "arguments": {}', '"get_time", "argu')
    assert [c["name"] for c in tools.parse_calls(one, "hermes", broken_second)[1]] == [
        "get_weather"]
    assert tools.parse_tools({"tools": [WEATHER], "parallel_tool_calls": None}).parallel
    # Llama-3.x with special tokens kept in the text: the tag is not streamed as content
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    deltas, reason = _run_stream(tools.ToolCallStream(treq(), "llama3"),
                                 [tagged[:14], tagged[14:30], tagged[30:]])
    assert [d for d in deltas if "content" in d] == [] and reason == "tool_calls"
    assert tools.finish_reason(calls, "stop") == "tool_calls"
    assert tools.finish_reason(calls, "length") == "length"
    assert tools.finish_reason([], "stop") == "stop"


def _run_stream(stream, pieces, reason="stop"):
    deltas = [d for p in pieces if (d := stream.push(p)) is not None]
    last, reason = stream.finish(reason)
    return deltas + last, reason


def test_stream_holds_back_a_tag_and_sends_calls_whole():
    pieces = ["Sure", ". <tool", "_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}\n",
              "</tool_call>"]
    deltas, reason = _run_stream(tools.ToolCallStream(treq(), "hermes"), pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Sure. "  # never a piece of the tag
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_time")]
    assert reason == "tool_calls"
    plain, reason = _run_stream(tools.ToolCallStream(treq(), "hermes"), ["Hello", " <b>"])
    assert "".join(d["content"] for d in plain) == "Hello <b>" and reason == "stop"


def test_stream_of_a_named_function_sends_its_arguments_as_written():
    named = treq({"type": "function", "function": {"name": "get_weather"}})
    deltas, reason = _run_stream(tools.ToolCallStream(named, "hermes"),
                                 ['{"city"', ': "Oslo"}'])
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_")
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(args) == {"city": "Oslo"} and reason == "tool_calls"


def test_tool_aware_template_gets_tools_and_earlier_calls(smollm2):
    from nanojax.tokenizer import Tokenizer
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }}{% endfor %}\n"
                "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
                "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
    tok = Tokenizer(smollm2.tokenizer.backend, {"chat_template": template})
    messages = [{"role": "user", "content": "Weather in <Oslo>?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "sunny"}]
    text = tools.render(tok, messages, treq())
    assert json.dumps(WEATHER) in text  # transformers' tojson: not HTML-escaped
    assert 'CALL get_weather {"city": "Oslo"}' in text and "tool: sunny" in text
    assert "TOOLS" not in tools.render(tok, messages, treq("none"))


def test_a_template_without_tools_gets_the_hermes_prompt(smollm2):
    messages = [{"role": "user", "content": "Weather?"}]
    text = tools.render(smollm2.tokenizer, messages, treq())
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text
    assert tools.tool_format(smollm2.tokenizer.chat_template) == "hermes"
    assert tools.tool_format("{{ '<|python_tag|>' }}") == "llama3"
