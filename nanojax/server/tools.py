"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` checked,
rendered into the prompt through the model's chat template (`tools=` as transformers
passes it), enforced with a grammar where the client requires a call, and the model's
text parsed back into OpenAI `tool_calls`, whole or as stream deltas.

What the model writes, by tool_choice:
  * a named function: the grammar is the function's parameters schema, so the output is
    exactly its arguments (as vLLM does);
  * "required": the grammar is a JSON array of {"name", "parameters"} objects, one
    alternative per tool, so every call names a declared tool and its arguments parse
    against that tool's schema;
  * "auto": free text in the model's own format: Hermes / Qwen2 (`<tool_call>{"name",
    "arguments"}</tool_call>`) or Llama-3.x (a JSON object {"name", "parameters"}, after
    `<|python_tag|>` or alone); a template that knows no tools gets the Hermes system
    prompt;
  * "none": the tools are not shown to the model and nothing is parsed.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

from nanojax.engine.structured import StructuredOutputsParams
from nanojax.server.api_error import bad, brief
from nanojax.tokenizer import ChatTemplateError

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass
class ToolRequest:
    tools: list[dict]             # as the client sent them: what the chat template gets
    parameters: dict[str, dict]   # function name -> its parameters' JSON schema
    choice: str                   # "none", "auto", "required" or "function"
    name: str | None = None       # the function tool_choice names
    parallel: bool = True         # parallel_tool_calls: false keeps one call a reply

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces a required call (None: the model chooses)."""
        if self.choice == "function":
            return StructuredOutputsParams(json=self.parameters[self.name])
        if self.choice == "required":
            calls = [{"type": "object", "additionalProperties": False,
                      "properties": {"name": {"const": n}, "parameters": p},
                      "required": ["name", "parameters"]}
                     for n, p in self.parameters.items()]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1,
                                                 **({} if self.parallel else {"maxItems": 1}),
                                                 "items": {"anyOf": calls}})
        return None


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice, or a 400 naming what is wrong; None when the
    request uses no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("tools", f"'tools' must be a list of at most {MAX_TOOLS} tools")
    params: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': "
                                     "{...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1-64 "
                      f"letters, digits, '_', '.' or '-', got {brief(name)}")
        if name in params:
            raise bad(f"tools[{i}].function.name", f"two tools are named {name!r}")
        if not isinstance(fn.get("description", ""), (str, type(None))):
            raise bad(f"tools[{i}].function.description", "a description must be a string")
        schema = fn.get("parameters")
        if schema is not None and not isinstance(schema, dict):
            raise bad(f"tools[{i}].function.parameters", "parameters must be a JSON schema "
                                                         "object")
        params[name] = schema or _EMPTY_PARAMETERS
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tools, params, choice or "auto", parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function":
        raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")
    name = fn.get("name")
    if name not in params:
        raise bad("tool_choice", f"'tool_choice' names the function {brief(name)}, which "
                                 "is not in 'tools'")
    return ToolRequest(tools, params, "function", name, parallel)


# ---- the prompt -------------------------------------------------------------------------
def tool_format(chat_template: str | None) -> str:
    """The format the model writes its calls in, from its chat template."""
    t = chat_template or ""
    return "llama3" if "<|python_tag|>" in t or "ipython" in t else "hermes"


def knows_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def render(tokenizer, messages: list[dict], treq: ToolRequest | None,
           template_kwargs: dict | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False) -> str:
    """The chat prompt: tools through the template, or (a template that knows none) as
    the Hermes system prompt with calls and results written as Hermes text;
    template_kwargs: the request's chat_template_kwargs. continue_final_message: the text
    ends where the last message's content does (its end-of-turn cut off), as vLLM's."""
    tools = treq.tools if treq is not None and treq.choice != "none" else None
    template = tokenizer.chat_template
    uses_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not knows_tools(template) and (tools or uses_calls):
        messages, tools = _as_hermes_text(messages, tools), None
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, template_kwargs=template_kwargs)
    if continue_final_message:
        final = messages[-1]["content"].strip()
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ChatTemplateError("continue_final_message: the chat template does not "
                                    "write the last message's content as given (or it is "
                                    "empty)")
        text = text[:end + len(final)]
    return text


def _as_hermes_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "".join(f"{HERMES_OPEN}\n{json.dumps(c['function'])}\n{HERMES_CLOSE}"
                            for c in m["tool_calls"])
            m = {"role": "assistant", "content": (m["content"] or "") + calls}
        elif m["role"] == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools:
        listed = "\n".join(json.dumps(t) for t in tools)
        prompt = ("# Tools\n\nYou may call one or more functions to assist with the user "
                  "query.\n\nYou are provided with function signatures within <tools></tools>"
                  f" XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return "
                  "a json object with function name and arguments within <tool_call>"
                  "</tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                  "\"arguments\": <args-json-object>}\n</tool_call>")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- the output -------------------------------------------------------------------------
def _call(obj) -> dict | None:
    """{"name", "arguments" (JSON text)} from a parsed call object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str)
            else json.dumps(args)}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(treq: ToolRequest, fmt: str, text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished output; calls: [{"name", "arguments"}], only the
    first without parallel_tool_calls. Text that does not parse as calls stays content."""
    if treq.choice == "function":
        return None, [{"name": treq.name, "arguments": text}]
    calls = None
    if treq.choice == "required":
        parsed = _loads(text)
        if isinstance(parsed, list):
            calls = [_call(c) for c in parsed][:None if treq.parallel else 1]
        return (text, []) if not calls or None in calls else (None, calls)
    if fmt == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        calls = [_call(_loads(body)) for body in _HERMES_CALL.findall(text, start)]
        content = text[:start].rstrip() or None
    else:
        body = text.strip().removeprefix(LLAMA3_TAG).strip()
        if not body.startswith("{"):
            return text, []
        content, calls = None, [_call(_loads(part)) for part in body.split(";")]
    if not treq.parallel:
        calls = calls[:1]
    return (text, []) if not calls or None in calls else (content, calls)


def openai_calls(calls: list[dict], with_index: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        d = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
        out.append({"index": i, **d} if with_index else d)
    return out


def finish_reason(calls: list[dict], reason: str | None) -> str | None:
    """'tool_calls' for an output that ended with complete calls."""
    return "tool_calls" if calls and reason == "stop" else reason


class ToolCallStream:
    """One choice's stream: content deltas pass through until a call may begin; calls are
    sent whole when the output ends, except a named function's arguments, which stream
    as they are written (the openai client joins them by index)."""

    def __init__(self, treq: ToolRequest, fmt: str):
        self.treq, self.fmt = treq, fmt
        self.text, self.sent = "", 0     # the output so far; how much went out as content
        self.holding = treq.choice == "required"
        self.call_id = None

    def push(self, delta: str) -> dict | None:
        """The delta for new output text, or None (nothing to send yet)."""
        self.text += delta
        if self.treq.choice == "function":
            return self._argument_delta(delta)
        if not self.holding:
            upto = self._content_end()
            if upto > self.sent:
                content, self.sent = self.text[self.sent:upto], upto
                return {"content": content}
        return None

    def _argument_delta(self, delta: str) -> dict | None:
        if self.call_id is None:
            self.call_id = f"call_{uuid.uuid4().hex[:24]}"
            return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                    "function": {"name": self.treq.name,
                                                 "arguments": delta}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else None

    def _content_end(self) -> int:
        """How much of the text is surely content; sets holding where a call begins."""
        if self.fmt == "hermes":
            start = self.text.find(HERMES_OPEN)
            if start >= 0:
                self.holding = True
                return start
            for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
                if HERMES_OPEN.startswith(self.text[-k:]):  # a tag may be starting
                    return len(self.text) - k
            return len(self.text)
        # <|python_tag|> is in the text where special tokens are kept (skip_special_tokens)
        head = self.text.lstrip().removeprefix(LLAMA3_TAG).lstrip()
        if not head:
            return self.sent
        if self.sent == 0 and head[0] == "{":  # Llama-3.x writes a call as the whole output
            self.holding = True
            return 0
        return len(self.text)

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas of the choice and its finish_reason."""
        if self.treq.choice == "function":
            first = self._argument_delta("") if self.call_id is None else None
            return [first] if first else [], finish_reason([1], reason)
        content, calls = parse_calls(self.treq, self.fmt, self.text)
        deltas = []
        if not calls:
            content = self.text
        rest = (content or "")[self.sent:]
        if rest:
            deltas.append({"content": rest})
        if calls:
            deltas.append({"tool_calls": openai_calls(calls, with_index=True)})
        return deltas, finish_reason(calls, reason)
