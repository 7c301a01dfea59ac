"""Structured outputs in the engine: every constrained output obeys its constraint, on the
embedded SmolLM2 model (async scheduling: the mask of step i+1 needs step i's token)."""
import dataclasses
import functools
import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

from nanojax.engine.sampling import SamplingParams  # noqa: E402
from nanojax.engine.structured import StructuredOutputError, StructuredOutputsParams  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def llm(smollm2):
    from nanojax.engine.llm import LLM
    return LLM(smollm2, b_dense=64, num_pages=96, max_model_len=512, max_num_seqs=24)


def chat(llm, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def test_bitmask_is_unpacked_as_llguidance_packs_it():
    from llguidance.numpy import apply_token_bitmask_inplace
    from nanojax.engine.sampling import apply_bitmask
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 100)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    np.testing.assert_array_equal(np.asarray(apply_bitmask(logits, mask)), want)


def test_compact_masks_equal_the_whole_batch_mask():
    """A step's masks for its constrained rows only, scattered on the device (padding rows
    past the batch dropped), give the logits a whole-batch mask gives."""
    from nanojax.engine.sampling import apply_bitmask
    from nanojax.engine.structured import mask_rows
    rng = np.random.default_rng(1)
    num_rows, words = 64, 4
    logits = rng.standard_normal((num_rows, 100)).astype(np.float32)
    rows = np.array([3, 17, 40, 63], np.int32)
    size = mask_rows(len(rows), num_rows)
    assert size == 8 and mask_rows(8, num_rows) == 8 and mask_rows(9, num_rows) == 64
    compact = np.full((size, words), -1, np.int32)
    compact[:len(rows)] = rng.integers(-2**31, 2**31, size=(len(rows), words)).astype(np.int32)
    index = np.concatenate([rows, np.full(size - len(rows), num_rows, np.int32)])  # padding
    full = np.full((num_rows, words), -1, np.int32)
    full[rows] = compact[:len(rows)]
    assert (np.asarray(apply_bitmask(logits, full)) == -np.inf).any()  # the masks mask
    np.testing.assert_array_equal(
        np.asarray(apply_bitmask(logits, compact, index)), np.asarray(apply_bitmask(logits, full)))


def test_constraints_hold_in_a_mixed_batch(llm):
    """JSON schema, any JSON object, regex, choice and a Lark grammar share a batch with an
    unconstrained request, which samples what it samples alone."""
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate(chat(llm, "Say hello."), free)[0]
    specs = [{"json": PERSON}, {"json_object": True}, {"regex": r"[0-9]{3}-[a-z]{2}"},
             {"choice": ["Paris", "London", "Berlin"]},
             {"grammar": 'start: "yes" | "no" | "maybe"'}]
    params = [SamplingParams(max_tokens=48, temperature=0.8, seed=i,
                             structured_outputs=s) for i, s in enumerate(specs)]
    questions = ["Describe a person as JSON.", "Reply in JSON.", "A code?",
                 "The capital of France?", "Is it raining?"]
    outs = llm.generate([chat(llm, q) for q in questions] + [chat(llm, "Say hello.")],
                        params + [free])
    person, obj, code, city, answer, hello = outs
    jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", code.text)
    assert city.text in ("Paris", "London", "Berlin")
    assert answer.text in ("yes", "no", "maybe")
    for out in (person, code, city, answer):
        assert out.finish_reason == "stop"
    if obj.finish_reason == "stop":  # an open object may run to max_tokens
        assert isinstance(json.loads(obj.text), dict)
    assert hello.token_ids == alone.token_ids


def test_cut_by_max_tokens_ends_length(llm):
    out = llm.generate(chat(llm, "A person as JSON."), SamplingParams(
        max_tokens=3, temperature=0, structured_outputs={"json": PERSON}))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith('{"')


def test_only_steps_with_a_constrained_row_fill_a_mask(llm, monkeypatch):
    grammars, calls = llm.engine.grammars, []
    fill = grammars.bitmask
    monkeypatch.setattr(grammars, "bitmask",
                        lambda rows, n, *fixed: calls.append(rows) or fill(rows, n, *fixed))
    llm.generate(chat(llm, "Hi"), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert calls == []  # the sampler took no mask: no extra work, no other variant
    llm.generate(chat(llm, "Hi"), SamplingParams(max_tokens=3, temperature=0,
                                                 structured_outputs={"regex": "[a-z]{9}"}))
    assert len(calls) == 3 and all(len(rows) == 1 for rows in calls)


@pytest.mark.parametrize("spec, needle", [
    ({"regex": "a(b"}, "unclosed group"),
    ({"json": {"type": "bogus"}}, "bogus"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    # hostile input reaches the engine's error, not a raw exception
    ({"regex": "\ud800+"}, "regex: .*surrogates"),
    ({"json": {"type": "number", "minimum": float("nan")}}, "json:"),
    ({"json": functools.reduce(lambda d, _: {"type": "object", "properties": {"a": d}},
                               range(3000), {"type": "object"})}, "json: .*recursion"),
])
def test_a_constraint_that_does_not_compile_is_refused(llm, spec, needle):
    from nanojax.engine.llm_engine import RequestError
    with pytest.raises(RequestError, match=needle):
        llm.engine.add_request("hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.requests


def test_malformed_constraints_are_refused_at_once():
    for fields in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": "{not json"},
                   {"regex": ""}):
        with pytest.raises(StructuredOutputError):
            StructuredOutputsParams(**fields)


def test_compiled_grammars_are_cached_by_text(llm):
    grammars = llm.engine.grammars
    spec = StructuredOutputsParams(regex="[ab]{2}c")
    first, second = grammars.matcher(spec), grammars.matcher(spec)
    assert first is not second  # each request advances its own copy
    assert len([k for k in grammars._cache if "[ab]{2}c" in k]) == 1
    assert first.consume_token(llm.tokenizer.encode("a")[0])
    assert second.compute_bitmask() != first.compute_bitmask()


# ---- property: generated schemas -------------------------------------------------------
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from(["red", "green", "blue", 1,
                                                                 None]), min_size=1,
                                                max_size=3, unique=True)))
_names = st.text("abcdefgh", min_size=1, max_size=5)


def _object(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner,
              st.integers(1, 3)),
    st.dictionaries(_names, inner, min_size=1, max_size=3).map(_object)), max_leaves=4)
_schema = st.dictionaries(_names, _value, min_size=1, max_size=3).map(_object)


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(_schema, min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_every_output_parses_and_validates(llm, schemas, seed):
    params = [SamplingParams(max_tokens=256, temperature=1.0, seed=seed + i,
                             structured_outputs={"json": s}) for i, s in enumerate(schemas)]
    outs = llm.generate([chat(llm, "Fill in the JSON.")] * len(schemas), params)
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


# ---- the engine's bookkeeping around constrained requests --------------------------------
ARRAY = {"json": {"type": "array", "items": {"type": "integer"}}}
ARRAY_PREFIX = re.compile(r"\[((-?(0|[1-9][0-9]*),)*-?([0-9]*))?")


def _is_array_or_prefix(text: str, finish_reason: str) -> bool:
    if finish_reason == "stop":
        return isinstance(json.loads(text), list)
    return ARRAY_PREFIX.fullmatch(text) is not None


def test_aborting_a_constrained_request_leaves_the_others_running(llm):
    """Aborted between steps with its row's token in flight: its matcher is released,
    and the other constrained request still obeys its grammar to the end."""
    eng = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, structured_outputs=ARRAY)
    gone, kept = (eng.add_request(chat(llm, q), params) for q in ("Numbers?", "Digits?"))
    seq = eng.requests[gone]
    for _ in range(3):
        eng.step()
    assert eng.abort_request(gone)
    done = eng.run_to_completion()
    assert done[gone].finish_reason == "abort" and seq.matcher is None
    out = done[kept]
    assert _is_array_or_prefix(out.text, out.finish_reason), out.text
    assert eng.is_idle and not eng.requests


def test_the_grammar_compiler_is_built_once_under_concurrent_checks(llm, monkeypatch):
    """The server checks constraints on its threads while the engine's thread makes
    matchers: all of them get the one compiler."""
    import threading
    import time

    import nanojax.engine.llm_engine as llm_engine
    real = llm_engine.GrammarCompiler

    class Slow(real):  # a tokenizer that takes a while to build, as a real one does
        def __init__(self, *a, **kw):
            time.sleep(0.05)
            super().__init__(*a, **kw)

    eng = llm.engine
    monkeypatch.setattr(llm_engine, "GrammarCompiler", Slow)
    monkeypatch.setattr(eng, "_grammars", None)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(eng.grammars)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 4 and len({id(g) for g in seen}) == 1


def test_reading_the_previous_step_for_a_mask_is_not_launch_time(llm, monkeypatch):
    """A constrained step reads the step before it while launching (for the mask): that
    wait for the device is wait time, not the launch's host time in the records."""
    from nanojax.engine.runner import StepOutput
    import time
    to_host = StepOutput.to_host

    def slow_device(out):  # a device slower than the host, as on a GPU under load
        time.sleep(0.05)
        return to_host(out)

    monkeypatch.setattr(StepOutput, "to_host", slow_device)
    eng = llm.engine
    eng.stats.trace = []
    try:
        llm.generate([chat(llm, "Numbers?")] * 2, SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, structured_outputs=ARRAY))
        records = eng.stats.trace
    finally:
        eng.stats.trace = None
    assert len(records) >= 5
    for rec in records:
        assert rec.launch_s <= rec.host_s + 1e-4, (rec.launch_s, rec.host_s, rec.wait_s)


@pytest.mark.slow
def test_preempted_constrained_requests_resume_their_grammar(llm, smollm2):
    """Preempted (recompute) and run again, a constrained request's matcher has its
    outputs so far: the same tokens as without preemption, still under the grammar."""
    from nanojax.engine.llm import LLM
    prompts = [[1, 520 + i, 33, 28] for i in range(4)]  # 5 pages of 4 tokens each at the end
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                            structured_outputs=ARRAY)
    tight = LLM(smollm2, b_dense=16, num_pages=12, page_size=4, max_model_len=24,
                max_num_seqs=4, min_token_bucket=16, min_row_bucket=4,
                enable_prefix_caching=False, admission="greedy")  # few shapes, few compiles
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    roomy = llm.generate(prompts, params, use_tqdm=False)  # the module's: nothing preempted
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for out in outs:
        assert _is_array_or_prefix(out.text, out.finish_reason), out.text


def test_masks_filled_on_the_dispatch_thread_give_the_same_tokens(llm, smollm2, monkeypatch):
    """With async dispatch (the GPU default) a constrained step's mask is filled, and its
    sampler dispatched, on the runner's dispatch thread while the engine thread goes on:
    the same tokens as the engine thread filling it, every output under its grammar."""
    import threading
    from nanojax.engine.llm import LLM
    threaded = LLM(smollm2, b_dense=64, num_pages=96, max_model_len=512, max_num_seqs=24,
                   async_dispatch=True)
    grammars, fill_threads = threaded.engine.grammars, set()
    fill = grammars.bitmask
    monkeypatch.setattr(grammars, "bitmask", lambda rows, n, *fixed: fill_threads.add(
        threading.current_thread().name) or fill(rows, n, *fixed))
    prompts = [chat(llm, q) for q in ("Describe a person as JSON.", "Numbers?", "Say hi.")]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=3,
                             structured_outputs={"json": PERSON}),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                             structured_outputs=ARRAY),
              SamplingParams(max_tokens=10, temperature=0)]
    want = llm.generate(prompts, params, use_tqdm=False)
    got = threaded.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert fill_threads and all(n.startswith("nanojax-dispatch") for n in fill_threads)
    assert _is_array_or_prefix(got[1].text, got[1].finish_reason), got[1].text
    if got[0].finish_reason == "stop":
        jsonschema.validate(json.loads(got[0].text), PERSON)


def test_allowed_token_ids_mask_every_sample(tiny_bundle):
    """vLLM's allowed_token_ids: every token, greedy or sampled, is one of them (the
    unconstrained greedy tokens are not), beside a grammar-free row and without a
    tokenizer's grammar compiler; the packed mask has exactly those bits."""
    import numpy as np

    from nanojax import SamplingParams
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.structured import token_mask
    m = token_mask([0, 5, 31, 32, 70], 100)
    assert [32 * w + j for w in range(len(m)) for j in range(32)
            if (int(m[w]) >> j) & 1] == [0, 5, 31, 32, 70]
    eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=64, min_token_bucket=16,
                                              min_row_bucket=4))
    prompt = [5, 6, 7, 8, 9]
    free = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    alone = eng.run_to_completion()[free].token_ids
    allowed = sorted(set(range(200, 260)) - set(alone))
    rids = [eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=t, seed=1,
                                                   ignore_eos=True, allowed_token_ids=allowed))
            for t in (0.0, 1.0)]
    again = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    done = eng.run_to_completion()
    for rid in rids:
        assert set(done[rid].token_ids) <= set(allowed), done[rid].token_ids
    # the masked rows' neighbour is untouched: the same greedy tokens as alone
    assert done[again].token_ids == alone
    assert not np.isin(done[again].token_ids, allowed).any()
    assert eng._grammars is None  # no tokenizer-built compiler was needed


def test_bad_words_tokens_and_bans():
    """vLLM's reading: a word at the start and, where a space makes another first token,
    inside a text; each word's last token is banned where the output ends with the rest."""
    from nanojax.engine.structured import bad_words_token_ids, banned_tokens

    class Tok:  # words split on letters: "a b" -> [1, 2]; a leading space is its own id
        def encode(self, text, add_special_tokens=True):
            return ([100] if text.startswith(" ") else []) + [ord(c) - 96 for c in text.strip()]
    assert bad_words_token_ids(Tok(), ["ab", " c"], 200) == [(1, 2), (3,)]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad_words_token_ids(Tok(), ["z"], 20)
    from nanojax.engine.sampling import SamplingError
    for words in (["\ud800"], [""], [" "], [1], ["x"] * 257):
        with pytest.raises(SamplingError, match="bad_words"):
            SamplingParams(bad_words=words)
    ids = [(7,), (1, 2), (1, 2, 3)]
    assert banned_tokens(ids, []) == [7]
    assert banned_tokens(ids, [5, 1]) == [7, 2]
    assert banned_tokens(ids, [1, 2]) == [7, 3]
    assert banned_tokens(ids, [2, 1]) == [7, 2]


def test_bad_words_are_never_written(llm):
    """The words the unconstrained greedy output wrote are avoided with bad_words (their
    tokens never follow each other in the output), beside a row that keeps its tokens; a
    grammar whose only answer is a bad word still answers (the ban yields to it rather
    than leave the sampler no token), and a choice loses its banned answer."""
    from nanojax.engine.structured import bad_words_token_ids
    tok = llm.tokenizer
    prompt = chat(llm, "Name three colours.")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = llm.generate(prompt, greedy)[0]
    words = sorted({w.strip(".,!*:") for w in free.text.split()} - {""}, key=len)[-3:]
    banned = bad_words_token_ids(tok, words, llm.engine.model_config.vocab_size)
    assert any(len(ids) > 1 for ids in banned) or len(banned) >= 3
    outs = llm.generate([prompt, prompt],
                        [dataclasses.replace(greedy, bad_words=words), greedy])
    got = outs[0].token_ids
    for ids in banned:
        n = len(ids)
        assert all(tuple(got[i:i + n]) != ids for i in range(len(got) - n + 1)), (ids, got)
    assert got != free.token_ids and outs[1].token_ids == free.token_ids
    choice = {"choice": ["Paris", "Berlin"]}
    question = chat(llm, "The capital of France?")
    out = llm.generate(question, SamplingParams(max_tokens=8, temperature=0,
                                                structured_outputs=choice,
                                                bad_words=["Paris"]))[0]
    assert out.text == "Berlin"
    out = llm.generate(question, SamplingParams(max_tokens=8, temperature=0,
                                                structured_outputs={"choice": ["Paris"]},
                                                bad_words=["Paris"]))[0]
    assert out.text == "Paris" and out.finish_reason == "stop"


def test_allowed_token_ids_narrow_a_grammar(llm):
    """A grammar and allowed_token_ids on one row: both masks apply (ANDed), so of the
    choice only the answer spelled with the allowed tokens can come out."""
    tok = llm.tokenizer
    allowed = tok.encode("Berlin") + list(tok.eos_token_ids)
    out = llm.generate(chat(llm, "The capital of France?"), SamplingParams(
        max_tokens=8, temperature=0, structured_outputs={"choice": ["Paris", "Berlin"]},
        allowed_token_ids=allowed))[0]
    assert out.text == "Berlin" and out.finish_reason == "stop"
