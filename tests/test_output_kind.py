"""SamplingParams.output_kind: what each RequestOutput of a request holds (cumulative,
delta, final_only), in the engine and through the server (a stream reads deltas, a whole
response only the finished output). The model is the stand-in (engine/mock_forward.py),
its outputs known in advance, with SmolLM2's tokenizer so that text is detokenized."""
import dataclasses
import json
import urllib.request

import numpy as np
import pytest
from test_server import ServerThread, _metrics

from nanojax.config import EngineConfig, named_shape
from nanojax.engine.llm import LLM
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.mock_forward import MockForward, mock_outputs, mock_params
from nanojax.engine.sampling import SamplingError, SamplingParams
from nanojax.models.bundle import ModelBundle

MODEL = "smollm2-135m"  # the name test_server's ServerThread serves under
ENGINE = dict(b_dense=64, page_size=8, num_pages=128, max_model_len=256, max_num_seqs=8,
              step_cache=False)
KINDS = ("cumulative", "delta", "final_only")


@pytest.fixture(scope="module")
def bundle():
    """The mock model over SmolLM2's vocabulary, with its tokenizer."""
    from checkpoints.loader import load_tokenizer
    tok = load_tokenizer(MODEL)
    cfg = dataclasses.replace(named_shape("tiny"), vocab_size=tok.vocab_size)
    return ModelBundle(cfg, mock_params(cfg.num_layers), tok)


def _engine(bundle, **kw) -> LLMEngine:
    return LLMEngine(bundle, EngineConfig(**{**ENGINE, **kw}), forward=MockForward(bundle.config))


def _prompts(bundle, n=2, seed=0):
    rng = np.random.default_rng(seed)
    # ids from 1000 up: no special tokens in the prompts
    return [rng.integers(1000, bundle.config.vocab_size, int(rng.integers(3, 30))).tolist()
            for _ in range(n)]


def _params(kind, max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          output_kind=kind, **kw)


def _collect(eng, requests) -> dict:
    """requests: {request_id: (prompt, params)} added to eng; every output of each, in
    order, until the engine is idle."""
    for rid, (p, sp) in requests.items():
        eng.add_request(p, sp, rid)
    outs = {rid: [] for rid in requests}
    while not eng.is_idle:
        for o in eng.step():
            outs[o.request_id].append(o)
    return outs


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_kinds_agree_in_one_batch(bundle, async_scheduling):
    """The three kinds of the same greedy requests, batched together: cumulative outputs
    grow by a token a step, deltas add up to the cumulative output (text and log-probs
    too), final_only gives one output."""
    eng = _engine(bundle, async_scheduling=async_scheduling)
    prompts, n = _prompts(bundle), 12
    reqs = {f"{kind}-{i}": (p, _params(kind, n, logprobs=2))
            for i, p in enumerate(prompts) for kind in KINDS}
    outs = _collect(eng, reqs)
    V = bundle.config.vocab_size
    for i, p in enumerate(prompts):
        want = mock_outputs(p, n, V)
        cum, delta, final = (outs[f"{kind}-{i}"] for kind in KINDS)
        # cumulative: one output a token, each everything so far
        assert [len(o.token_ids) for o in cum] == list(range(1, n + 1))
        assert cum[-1].token_ids == want and cum[-1].finished
        assert not any(o.finished for o in cum[:-1])
        for prev, o in zip([None] + cum[:-1], cum):
            before = prev.token_ids if prev else []
            assert o.token_ids[:len(before)] == before
            assert o.delta_token_ids == o.token_ids[len(before):]
            assert o.text.startswith(prev.text if prev else "")
            assert len(o.outputs[0].logprobs) == len(o.token_ids)
        last = cum[-1].outputs[0]
        assert [e["token_id"] for e in last.logprobs] == want
        assert all(len(e["top"]) == 2 and e["top"][0][0] == e["token_id"]
                   for e in last.logprobs)
        # delta: only what is new in each; concatenated, the cumulative output
        assert [len(o.token_ids) for o in delta] == [1] * n
        assert sum((o.token_ids for o in delta), []) == want
        assert all(o.delta_token_ids == o.token_ids for o in delta)
        assert "".join(o.text for o in delta) == last.text
        assert all(o.delta_text == o.text for o in delta)
        assert sum((o.outputs[0].logprobs for o in delta), []) == last.logprobs
        assert [o.finished for o in delta] == [False] * (n - 1) + [True]
        assert delta[-1].finish_reason == "length"
        # final_only: one output, finished, the whole
        assert len(final) == 1 and final[0].finished
        assert final[0].token_ids == want and final[0].text == last.text
        assert final[0].outputs[0].logprobs == last.logprobs
        assert final[0].first_token_latency is not None


def test_delta_text_holds_back_a_stop_string(bundle):
    """With a stop string, deltas never send text the stop later cuts: concatenated they
    are the cumulative (and final_only) text, cut before the stop."""
    eng = _engine(bundle)
    p = _prompts(bundle, 1, seed=3)[0]
    full = _collect(eng, {"full": (p, _params("final_only", 24))})["full"][0]
    text = full.text
    assert len(text) > 20, text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text[:text.find(stop)]
    outs = _collect(eng, {kind: (p, _params(kind, 24, stop=stop)) for kind in KINDS})
    assert outs["cumulative"][-1].text == cut == outs["final_only"][0].text
    assert "".join(o.delta_text for o in outs["delta"]) == cut
    assert "".join(o.text for o in outs["delta"]) == cut
    for kind in KINDS:
        assert outs[kind][-1].finish_reason == "stop"
        assert outs[kind][-1].outputs[0].stop_reason == stop
    assert sum((o.token_ids for o in outs["delta"]), []) == outs["cumulative"][-1].token_ids


def test_aborted_delta_request_ends_with_a_finished_output(bundle):
    eng = _engine(bundle)
    p = _prompts(bundle, 1, seed=4)[0]
    rid = eng.add_request(p, _params("delta", 50))
    got = []
    for _ in range(6):
        got += eng.step()
    assert got and eng.abort_request(rid)
    got += eng.run_to_completion().values()
    assert got[-1].finished and got[-1].finish_reason == "abort"
    tokens = sum((o.token_ids for o in got), [])
    assert tokens == mock_outputs(p, 50, bundle.config.vocab_size)[:len(tokens)]
    assert eng.allocator.num_used == 0


def test_invalid_output_kind_is_refused():
    with pytest.raises(SamplingError, match="output_kind"):
        SamplingParams(output_kind="stream")
    with pytest.raises(SamplingError, match="output_kind"):
        dataclasses.replace(SamplingParams(), output_kind=None)


def test_llm_generate_returns_the_finished_outputs(bundle):
    llm = LLM(bundle, forward=MockForward(bundle.config), config=EngineConfig(**ENGINE))
    prompts = _prompts(bundle, 3, seed=5)
    outs = llm.generate(prompts, _params("cumulative", 7), use_tqdm=False)
    V = bundle.config.vocab_size
    assert [o.token_ids for o in outs] == [mock_outputs(p, 7, V) for p in prompts]
    assert all(o.finished and o.finish_reason == "length" for o in outs)


# ---- the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(bundle):
    s = ServerThread(None, engine=_engine(bundle))
    yield s
    s.stop()


def _post(server, body: dict) -> bytes:
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


def _stream(server, body: dict) -> list[dict]:
    raw = _post(server, {**body, "stream": True}).decode()
    events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _body(prompt, max_tokens, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}


def test_stream_logprobs_and_usage_count_every_token(server, bundle):
    p, n = _prompts(bundle, 1, seed=6)[0], 10
    want = mock_outputs(p, n, bundle.config.vocab_size)
    chunks = _stream(server, _body(p, n, logprobs=2,
                                   stream_options={"include_usage": True}))
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n
    assert usage["usage"]["prompt_tokens"] == len(p)
    choices = [c for ch in chunks[:-1] for c in ch["choices"]]
    assert all(ch.get("usage") is None for ch in chunks[:-1])
    lps = [c["logprobs"] for c in choices]
    tokens = sum((lp["tokens"] for lp in lps), [])
    tok = bundle.tokenizer
    assert tokens == [tok.decode([t], skip_special_tokens=False) for t in want]
    assert len(sum((lp["token_logprobs"] for lp in lps), [])) == n
    tops = sum((lp["top_logprobs"] for lp in lps), [])
    assert len(tops) == n and all(len(t) == 2 for t in tops)
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    # the whole response: the same text and log-probs
    whole = json.loads(_post(server, _body(p, n, logprobs=2)))
    c = whole["choices"][0]
    assert c["text"] == "".join(ch["text"] for ch in choices)
    assert c["logprobs"]["tokens"] == tokens
    assert c["logprobs"]["token_logprobs"] == sum((lp["token_logprobs"] for lp in lps), [])
    assert c["logprobs"]["top_logprobs"] == tops
    # text offsets run on across a stream's chunks, into the whole text (as vLLM's)
    assert sum((lp["text_offset"] for lp in lps), []) == c["logprobs"]["text_offset"]
    assert whole["usage"]["completion_tokens"] == n
    assert server.idle()


def test_stream_of_n_choices_counts_all_their_tokens(server, bundle):
    p, n = _prompts(bundle, 1, seed=7)[0], 6
    chunks = _stream(server, _body([p, p[:-1]], n, n=2, temperature=1.0, seed=1,
                                   stream_options={"include_usage": True}))
    assert chunks[-1]["usage"]["completion_tokens"] == 4 * n
    by_index = {}
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            by_index.setdefault(c["index"], []).append(c)
    assert sorted(by_index) == [0, 1, 2, 3]
    for cs in by_index.values():
        assert cs[-1]["finish_reason"] == "length"


def test_metrics_count_a_whole_response(server, bundle):
    p, n = _prompts(bundle, 1, seed=8)[0], 9
    before = _metrics(server)
    whole = json.loads(_post(server, _body(p, n)))
    assert whole["usage"]["completion_tokens"] == n
    assert server.idle()
    after = _metrics(server)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["nanojax:generation_tokens_total"] == n
    assert d["nanojax:prompt_tokens_total"] == len(p)
    assert d["nanojax:time_to_first_token_seconds_count"] == 1
    assert d["nanojax:inter_token_latency_seconds_count"] == n - 1
    assert d["nanojax:e2e_request_latency_seconds_count"] == 1
    assert d["nanojax:request_success_total"] == 1
    # the engine's first token, not the whole response's end
    assert 0 < d["nanojax:time_to_first_token_seconds_sum"] <= \
        d["nanojax:e2e_request_latency_seconds_sum"]
    # a stream's tokens are counted as well
    _stream(server, _body(p, n))
    assert server.idle()
    again = _metrics(server)
    assert again["nanojax:generation_tokens_total"] - after["nanojax:generation_tokens_total"] == n
    assert again["nanojax:time_to_first_token_seconds_count"] - \
        after["nanojax:time_to_first_token_seconds_count"] == 1
