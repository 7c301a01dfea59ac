"""A reasoning model's think block over HTTP (--reasoning-parser), on a scripted engine: the
mock forward (engine/mock_forward.py) whose greedy tokens are known in advance, and a
word-level tokenizer whose pieces for those tokens spell a reply that thinks first, as
JetStream tests its server with a mock engine. Checked with the openai client:
reasoning_content and content, whole and streamed (tags cut across deltas, every token's
logprob delivered, n = 2), tool calls parsed after the thinking, an output constraint
applied after it, and Qwen3's enable_thinking switch."""
import dataclasses

import pytest
from test_server import MODEL, ServerThread

from nanojax.config import EngineConfig, named_shape
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.mock_forward import MockForward, mock_outputs, mock_params
from nanojax.models.bundle import ModelBundle

openai = pytest.importorskip("openai")

VOCAB = 96
CFG = dataclasses.replace(named_shape("tiny"), vocab_size=VOCAB)
# what the scripted model writes after the prompt "q": one piece a token
SCRIPT = ["<think>", "\n", "Let", " me", " check", ".\n", "</", "think>", "\n\n",
          "<tool_call>", '\n{"name": "get_time", "arguments": {}}\n', "</tool_call>"]
THINKING, ANSWER = "\nLet me check.\n", '\n\n<tool_call>\n{"name": "get_time", ' \
                                        '"arguments": {}}\n</tool_call>'
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}


def _scripted_tokenizer():
    """A word-level tokenizer in which the mock's greedy continuation of "q" is SCRIPT:
    the prompt token's id is picked so that the script's tokens are all different."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from nanojax.tokenizer import Tokenizer
    byte_char = bytes_to_unicode()  # byte-level pieces, as GPT-2's (what grammars read)
    for q in range(2, VOCAB - 1):
        out = mock_outputs([q], len(SCRIPT), VOCAB)
        if len(set(out)) == len(out) and not {0, q, VOCAB - 1} & set(out):
            break
    vocab = {f"<unused{i}>": i for i in range(VOCAB)}
    script = {"".join(byte_char[b] for b in piece.encode()): i for piece, i in zip(SCRIPT, out)}
    vocab = {piece: i for piece, i in vocab.items() if i not in out}  # one piece an id
    vocab.update({"[UNK]": 0, "q": q, **script})
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    # every conversation is the one prompt token "q" (the script follows it, whatever the
    # messages, tools or template switches say); the last id is the EOS grammars need
    return Tokenizer(backend, {"chat_template": "q", "eos_token_ids": [VOCAB - 1]})


@pytest.fixture(scope="module")
def client():
    bundle = ModelBundle(CFG, mock_params(CFG.num_layers), _scripted_tokenizer())
    engine = LLMEngine(bundle, EngineConfig(b_dense=32, page_size=4, num_pages=96,
                                            max_model_len=256, step_cache=False),
                       forward=MockForward(CFG))
    server = ServerThread(bundle, engine=engine, reasoning_parser="qwen3")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()


ASK = [{"role": "user", "content": "What time is it?"}]
KW = dict(model=MODEL, messages=ASK, max_tokens=len(SCRIPT), temperature=0)


def test_the_think_block_is_reasoning_content_and_the_rest_content(client):
    m = client.chat.completions.create(**KW).choices[0].message
    assert (m.reasoning_content, m.content) == (THINKING, ANSWER)


def test_streamed_in_each_choice_with_every_tokens_logprob(client):
    """The tags come in two tokens each ("</" "think>"): held back, never sent as text,
    and the held tokens' logprobs ride on the next chunk of their choice."""
    got = [{"reasoning_content": "", "content": "", "logprobs": 0} for _ in range(2)]
    for chunk in client.chat.completions.create(**KW, n=2, logprobs=True, stream=True):
        for c in chunk.choices:
            got[c.index]["logprobs"] += len(c.logprobs.content) if c.logprobs else 0
            for field in ("reasoning_content", "content"):
                got[c.index][field] += getattr(c.delta, field, None) or ""
    assert got == [{"reasoning_content": THINKING, "content": ANSWER,
                    "logprobs": len(SCRIPT)}] * 2


def test_tool_calls_are_parsed_after_the_thinking(client):
    for stream in (False, True):
        r = client.chat.completions.create(**KW, tools=[TIME], stream=stream)
        if not stream:
            m = r.choices[0].message
            assert m.reasoning_content == THINKING and not (m.content or "").strip()
            assert [t.function.name for t in m.tool_calls] == ["get_time"]
            assert r.choices[0].finish_reason == "length"  # the script fills max_tokens
            continue
        thinking, names = "", []
        for chunk in r:
            for c in chunk.choices:
                thinking += getattr(c.delta, "reasoning_content", None) or ""
                names += [t.function.name for t in c.delta.tool_calls or []]
        assert thinking == THINKING and names == ["get_time"]


def test_an_output_constraint_applies_after_the_thinking(client):
    """A regex the script's answer satisfies: the thinking is left free (no mask stops
    the model's own tokens), the answer obeys the regex."""
    r = client.chat.completions.create(**KW, extra_body={
        "guided_regex": r'\s*<tool_call>\s*\{"name": "get_time", "arguments": \{\}\}\s*</tool_call>'})
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (THINKING, ANSWER)


def test_enable_thinking_false_turns_the_split_off(client):
    """Qwen3's switch (its template then closes the think block in the prompt): whatever
    the model writes is content (the scripted model writes the same, tags and all)."""
    m = client.chat.completions.create(
        **KW, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert m.reasoning_content is None and m.content == THINKING.join(["<think>", "</think>"]) \
        + ANSWER
