"""Our GGUF tokenizer against transformers' GGUF tokenizer on varied text."""
import pytest

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "Ünïcödé: naïve café, Straße, 日本語のテキスト, 🤖🚀 emoji, Ελληνικά, עברית",
    "numbers 1234567890 and 3.14159, 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> special tokens inline <|im_end|>",
    "code: def f(x):\n    return x ** 2  # square\n",
    "",
    "a" * 300,
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(text, smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    ours = smollm2.tokenizer.encode(text)
    theirs = hf_tok.encode(text, add_special_tokens=True)
    assert ours == theirs
    assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == \
        hf_tok.decode(theirs, skip_special_tokens=False)
    assert smollm2.tokenizer.decode(ours) == hf_tok.decode(theirs, skip_special_tokens=True)


def test_chat_template_matches_transformers(smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    ours = smollm2.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    theirs = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ours == theirs


def test_special_tokens(smollm2):
    tok = smollm2.tokenizer
    assert tok.eos_token_ids == (2,)
    assert tok.encode("<|im_end|>") == [2]
    assert tok.bos_token_id == 1


def test_incremental_detokenizer_equals_full_decode(smollm2):
    from nanojax.tokenizer import IncrementalDetokenizer
    tok = smollm2.tokenizer
    text = "Emoji 🤖 and 日本語, then ascii."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "window"])
def test_incremental_detokenizer_paths_agree(smollm2, monkeypatch, stream):
    """tokenizers' DecodeStream and the two-window fallback give the same deltas: random
    ids (broken UTF-8 sequences, special tokens among them), one or three at a time."""
    import numpy as np
    from nanojax import tokenizer as tokenizer_mod
    if not stream:
        monkeypatch.setattr(tokenizer_mod, "_decode_stream", lambda skip: None)
    tok = smollm2.tokenizer
    rng = np.random.default_rng(7)
    for n, skip in ((1, True), (3, True), (1, False)):  # skip_special_tokens either way
        ids = (rng.integers(0, tok.vocab_size, 90).tolist() + tok.encode("日本語 🤖")
               + tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False))
        detok = tokenizer_mod.IncrementalDetokenizer(tok, skip)
        assert (detok._stream is not None) == stream
        pieces = [detok.push(ids[i:i + n]) for i in range(0, len(ids), n)]
        assert "".join(pieces) == detok.text
        whole = tok.decode(ids, skip_special_tokens=skip)
        assert detok.text == whole, (n, detok.text[-40:], whole[-40:])
