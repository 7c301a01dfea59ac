"""Reasoning models' thinking split from their answer on /v1/chat/completions, as vLLM's
`--reasoning-parser` does: Qwen3 and DeepSeek-R1 think in a `<think> ... </think>` block
before the answer; the thinking goes to `message.reasoning_content` (streamed as
`delta.reasoning_content`), the rest to `content`, where tool calls are then parsed.

How an output is read (`mode_for`):
  * "implicit": the chat template may have opened the think block in the prompt (R1's,
    Qwen3-2507's), so the output is thinking up to `</think>` (a `<think>` it writes
    itself is dropped); one cut short by max_tokens is all thinking, content null. Both
    parsers, as vLLM's current ones. A request's output constraint (response_format, a
    required tool call) then applies after the thinking (structured.after_thinking);
  * "off": no thinking to split: qwen3 with `chat_template_kwargs: {"enable_thinking":
    false}` (the template wrote an empty think block into the prompt), a continued
    assistant message (continue_final_message) whose think block is closed or absent,
    and a server without a parser; a constraint applies from the first token.
"""
from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
MODES = ("implicit", "off")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def mode_for(parser: str | None, template_kwargs: dict, continued: str | None = None) -> str:
    """How a request's output is read (the module docstring); continued: the assistant
    message the output continues (continue_final_message), else None."""
    if parser is None or (parser == "qwen3" and template_kwargs.get("enable_thinking") is False):
        return "off"
    if continued is not None and continued.rfind(THINK_OPEN) <= continued.rfind(THINK_CLOSE):
        return "off"  # it continues the answer, not the thinking
    return "implicit"


def _held(text: str, tag: str) -> int:
    """How many trailing characters of text could be the start of tag (held back until the
    next delta says whether they are)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's output, delta by delta -> [(field, text)] with field
    "reasoning_content" or "content"; `finish` flushes what was held back."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"reasoning mode {mode!r}: one of {MODES}")
        self.mode = mode
        self.state = "start" if mode != "off" else "content"  # -> "reasoning" -> "content"
        self.pending = ""

    def push(self, delta: str) -> list[tuple[str, str]]:
        self.pending += delta
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(THINK_OPEN):
                self.pending, self.state = head[len(THINK_OPEN):], "reasoning"
            elif THINK_OPEN.startswith(head):
                return out  # blank so far, or a partial "<think>"
            else:
                self.state = "reasoning"
        if self.state == "reasoning":
            end = self.pending.find(THINK_CLOSE)
            if end < 0:
                keep = _held(self.pending, THINK_CLOSE)
                text, self.pending = (self.pending[:len(self.pending) - keep],
                                      self.pending[len(self.pending) - keep:])
                return out + ([("reasoning_content", text)] if text else [])
            if end:
                out.append(("reasoning_content", self.pending[:end]))
            self.pending, self.state = self.pending[end + len(THINK_CLOSE):], "content"
        if self.pending:
            out.append(("content", self.pending))
            self.pending = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        text, self.pending = self.pending, ""
        if not text:
            return []
        if self.state == "start":  # nothing but blanks or a partial "<think>" was written
            return [("reasoning_content", text)]
        return [("reasoning_content" if self.state == "reasoning" else "content", text)]


def split(mode: str, text: str) -> tuple[str | None, str | None]:
    """A whole output -> (reasoning_content, content), None for a part it lacks (an output
    with no thinking keeps its content as written, "" included)."""
    stream = ReasoningStream(mode)
    parts = {"reasoning_content": "", "content": ""}
    for field, piece in stream.push(text) + stream.finish():
        parts[field] += piece
    if not parts["reasoning_content"] and stream.state != "reasoning":
        return None, parts["content"]
    return parts["reasoning_content"] or None, parts["content"] or None
