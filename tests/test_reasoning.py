"""Reasoning models' <think> blocks split from the answer (--reasoning-parser), whole and
streamed in every chunking; chat_template_kwargs reach the template (Qwen3's
enable_thinking), checked first."""
import dataclasses

import pytest

from nanojax.server import reasoning
from nanojax.server.protocol import ApiError, parse_chat

CASES = [  # text, its split in the "implicit" mode (reasoning.py)
    ("<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
    ("Paris.", ("Paris.", None)),                       # the prompt opened the think block
    ("<think>cut short by max_tok", ("cut short by max_tok", None)),
    ("thought</think>Paris.", ("thought", "Paris.")),
    ("  <think>a</think>b", ("a", "b")),
    ("<think></think>Paris.", (None, "Paris.")),
    ("<thinking>x", ("<thinking>x", None)),
    ("<thi", ("<thi", None)),
    ("", (None, "")),
    ("<think>a</think>b</think>c", ("a", "b</think>c")),
]


@pytest.mark.parametrize("text, implicit", CASES)
def test_whole_outputs_split_in_each_mode(text, implicit):
    assert reasoning.split("implicit", text) == implicit
    assert reasoning.split("off", text) == (None, text)


def test_the_mode_follows_the_parser_and_enable_thinking():
    assert reasoning.mode_for(None, {}) == "off"
    for parser in reasoning.PARSERS:  # vLLM's current parsers: thinking until </think>
        assert reasoning.mode_for(parser, {}) == "implicit"
    assert reasoning.mode_for("qwen3", {"enable_thinking": False}) == "off"
    assert reasoning.mode_for("qwen3", {"enable_thinking": True}) == "implicit"
    assert reasoning.mode_for("deepseek_r1", {"enable_thinking": False}) == "implicit"
    # continue_final_message: thinking only if the continued message left a block open
    assert reasoning.mode_for("qwen3", {}, "<think>\nLet me see") == "implicit"
    assert reasoning.mode_for("qwen3", {}, "<think>x</think>\n\nThe answer") == "off"
    assert reasoning.mode_for("deepseek_r1", {}, "The answer is") == "off"


def _streamed(mode, pieces):
    s = reasoning.ReasoningStream(mode)
    parts = {"reasoning_content": "", "content": ""}
    for p in pieces:
        for field, text in s.push(p):
            assert text  # no empty deltas
            parts[field] += text
    for field, text in s.finish():
        parts[field] += text
    return parts


@pytest.mark.parametrize("mode", reasoning.MODES)
@pytest.mark.parametrize("text, implicit", CASES)
def test_every_chunking_streams_what_the_whole_output_splits_to(mode, text, implicit):
    """Tags cut anywhere by the detokenizer's deltas: held back, never leaked as text."""
    want = reasoning.split(mode, text)
    chunkings = [[text], list(text)] + [[text[:i], text[i:j], text[j:]]
                                        for i in range(len(text) + 1)
                                        for j in range(i, len(text) + 1, 3)]
    for pieces in chunkings:
        got = _streamed(mode, pieces)
        assert (got["reasoning_content"] or None, got["content"]) == (
            want[0], want[1] or ""), pieces


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="implicit"):
        reasoning.ReasoningStream("qwen3")


def test_a_constraint_after_thinking_leaves_the_thinking_free():
    """structured.after_thinking: free text up to </think>, then the constraint (every
    kind of constraint llguidance's text comes in: a JSON list of grammars, or Lark)."""
    from checkpoints.loader import load_tokenizer
    from nanojax.engine.structured import GrammarCompiler, StructuredOutputsParams as S
    tok = load_tokenizer("smollm2-135m")
    grammars = GrammarCompiler(tok, 49152, tok.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for spec, good, bad in [
            (S(json=schema), '<think>\nsay {"b": 2}?\n</think>{"a":1}', '</think>{"b":1}'),
            (S(choice=["yes", "no"]), "hmm</think>yes", "hmm</think>maybe"),
            (S(regex="[0-9]+"), "<think>\nnum\n</think>42", "</think>x"),
            (S(grammar='start: "a" b\nb: "c"'), "a</think>ac", "a</think>ab")]:
        spec = dataclasses.replace(spec, think_end="</think>")
        for text, want in ((good, True), (bad, False)):
            m = grammars.matcher(spec)
            ok = all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()
            assert ok == want, (spec, text)
        m = grammars.matcher(spec)  # before </think> nothing is constrained, nothing done
        assert all(m.consume_token(t) for t in tok.encode("Hmm, 123 {]")) and \
            not m.is_accepting()


def _chat(**extra):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **extra}, 1000)


@pytest.mark.parametrize("kw, needle", [
    ("yes", "must be an object"),
    ({f"v{i}": 1 for i in range(33)}, "at most 32"),
    ({"enable thinking": False}, "not a template variable"),
    ({"\ud800": False}, "not a template variable"),
    ({"messages": []}, "cannot set 'messages'"),
    ({"add_generation_prompt": False}, "cannot set"),
    ({"namespace": 1}, "cannot set 'namespace'"),  # Qwen3's template calls namespace()
    ({"raise_exception": "x"}, "cannot set 'raise_exception'"),
])
def test_bad_chat_template_kwargs_are_a_400(kw, needle):
    with pytest.raises(ApiError) as e:
        _chat(chat_template_kwargs=kw)
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
    assert needle in e.value.message


def test_chat_template_kwargs_reach_the_template(smollm2):
    """Qwen3's template switch, as its chat_template writes it."""
    from nanojax.server import tools
    from nanojax.tokenizer import Tokenizer
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined "
                "and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    tok = Tokenizer(smollm2.tokenizer.backend, {"chat_template": template})
    messages, parsed, _ = _chat(chat_template_kwargs={"enable_thinking": False})
    off = tools.render(tok, messages, None, parsed.chat_template_kwargs)
    on = tools.render(tok, messages, None, _chat()[1].chat_template_kwargs)
    assert off.endswith("<|assistant|><think>\n\n</think>\n\n") and on.endswith("<|assistant|>")


def test_a_template_that_fails_on_request_data_is_a_chat_template_error(smollm2):
    """Whatever a kwarg makes the template do (add a number to a string, divide by zero)
    comes back as ChatTemplateError (the server's 400), not a bare TypeError (a 500)."""
    from nanojax.tokenizer import ChatTemplateError
    from nanojax.server import tools
    from nanojax.tokenizer import Tokenizer
    tok = Tokenizer(smollm2.tokenizer.backend, {"chat_template": "{{ 1 / depth + width }}"})
    messages = [{"role": "user", "content": "hi"}]
    for kw in ({"depth": 0, "width": 1}, {"depth": 1, "width": "wide"}):
        with pytest.raises(ChatTemplateError, match="chat template failed"):
            tools.render(tok, messages, None, kw)


def test_an_earlier_turns_reasoning_content_reaches_the_template():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
            {"role": "user", "content": "and?"}]
    messages, _, _ = parse_chat({"messages": msgs}, 1000)
    assert messages[1]["reasoning_content"] == "greet back"
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{**msgs[1], "reasoning_content": 3}]}, 1000)
    assert e.value.param == "messages[0].reasoning_content"

