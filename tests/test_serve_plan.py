"""`nanojax serve --plan NAME|PATH|auto` (issue 20, item 2): which plan is chosen, and the
server running the nano-batch executor answers the openai client with the same greedy
tokens as the plain forward."""
import json

import pytest

from nanojax.config import named_shape
from nanojax.pipeline.choose import choose_plan, shipped_plans
from nanojax.pipeline.plan import PlanError
from test_pipeline import _plan_for
from test_server_hostile import tok_bundle  # noqa: F401  (the fixture)
from test_server import MODEL, ServerThread


def test_choose_plan():
    eight_b = named_shape("llama3-8b")
    assert "llama3-8b-1gpu" in shipped_plans()
    assert choose_plan(None, eight_b, 2048)[0] is None
    plan, why = choose_plan("auto", eight_b, 2048, backend="gpu")
    assert plan["b_dense"] == 2048 and "llama3-8b-1gpu" in why and "resized" not in why
    plan, why = choose_plan("auto", eight_b, 1024, backend="gpu")
    assert plan["b_dense"] == 1024 and "resized from B_dense 2048" in why
    plan, why = choose_plan("auto", eight_b, 2048, backend="cpu")
    assert plan is None and "only on a GPU" in why
    plan, why = choose_plan("auto", named_shape("tiny"), 32, backend="gpu")
    assert plan is None and "no shipped plan" in why
    with pytest.raises(PlanError, match="another model"):
        choose_plan("llama3-8b-1gpu", named_shape("tiny"), 32)
    with pytest.raises(PlanError, match="no plan file"):
        choose_plan("no-such-plan", eight_b, 2048)


def _serve_args(*extra):
    from nanojax.cli import build_parser
    return build_parser().parse_args(["serve", "--b-dense", "32", "--num-pages", "48",
                                      "--max-model-len", "128", "--max-num-seqs", "8",
                                      "--fixed-shapes", *extra])  # 2 shapes, compiled



def _answers(server) -> list:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = [[11, 200, 3000, 45], list(range(100, 140)), [7]]  # the 40 span a nano-batch cut
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0,
                                  logprobs=1)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6,
        temperature=0)
    return ([(c.index, c.logprobs.tokens) for c in sorted(r.choices, key=lambda c: c.index)]
            + [chat.choices[0].message.content])


def test_server_with_a_plan_gives_the_plain_forwards_tokens(tok_bundle, tmp_path):  # noqa
    from nanojax.pipeline.executor import PipelineForward
    from nanojax.server.cli import build_engine, warm_up
    path = tmp_path / "tiny-plan.json"
    path.write_text(json.dumps(_plan_for(tok_bundle.config, 32)))
    answers = {}
    for name, extra in (("plain", []), ("plan", ["--plan", str(path)])):
        engine, chosen = build_engine(_serve_args(*extra), tok_bundle)
        warm_up(engine)
        assert isinstance(engine.runner.forward, PipelineForward) == (name == "plan")
        assert (chosen["plan_json"] is not None) == (name == "plan") and chosen["plan"]
        server = ServerThread(tok_bundle, engine=engine)
        try:
            answers[name] = _answers(server)
            assert server.idle()
        finally:
            server.stop()
    assert answers["plan"] == answers["plain"]
    assert all(len(toks) == 8 for _, toks in answers["plain"][:3])
