"""The offline benchmark with a fraction of its requests under a JSON schema
(`nanojax bench throughput --structured-fraction`), on the embedded SmolLM2 model: the
chosen requests are constrained, their outputs are arrays of integers or prefixes of one,
and the result counts how they ended."""
import json
import re

import pytest

pytest.importorskip("llguidance")

from nanojax.bench.workload import (DEFAULT_STRUCTURED_SCHEMA,  # noqa: E402
                                    StructuredWorkload, make_requests, structured_rows)
from nanojax.cli import build_parser  # noqa: E402

# what a prefix of a JSON array of integers (no whitespace) can look like
ARRAY_PREFIX = re.compile(r"\[((-?(0|[1-9][0-9]*),)*-?([0-9]*))?")


def test_structured_rows_are_spread_evenly():
    assert structured_rows(8, 0.25) == [False, False, False, True] * 2
    assert structured_rows(5, 0.5) == [False, True, False, True, False]
    assert structured_rows(3, 0.0) == [False] * 3 and structured_rows(3, 1.0) == [True] * 3
    assert sum(structured_rows(1000, 0.3)) == 300


@pytest.mark.parametrize("value", ["nan", "-0.1", "1.5", "inf", "half"])
def test_a_fraction_outside_0_1_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--structured-fraction", value])
    assert "--structured-fraction" in capsys.readouterr().err


def _allows(mask_row, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def test_the_default_schema_never_closes_its_array(smollm2):
    """So every constrained request runs to its output length, as the others do."""
    from nanojax.engine.structured import GrammarCompiler, StructuredOutputsParams
    tok = smollm2.tokenizer
    grammars = GrammarCompiler(tok, smollm2.config.vocab_size, tok.eos_token_ids)
    matcher = grammars.matcher(StructuredOutputsParams(json=DEFAULT_STRUCTURED_SCHEMA))
    assert all(matcher.consume_token(t) for t in tok.encode("[1,2"))
    row = grammars.bitmask([(matcher, 0)], 1).mask[0]
    assert _allows(row, tok.encode(",")[0]) and not _allows(row, tok.encode("]")[0])


def test_half_the_requests_under_a_schema(smollm2):
    from nanojax.bench.offline import run_offline
    from nanojax.config import EngineConfig
    from nanojax.engine.llm_engine import LLMEngine
    # fixed shapes (the GPU default): every shape and sampler variant compiled by the
    # warm-up, the grammar-masked ones included; no prefix hashing (a quicker start)
    engine = LLMEngine(smollm2, EngineConfig(
        b_dense=32, num_pages=32, max_model_len=64, max_num_seqs=4, fixed_shapes=True,
        enable_prefix_caching=False))
    reqs = make_requests(4, smollm2.config.vocab_size, input_len=12, output_len=10)
    # the default schema never closes its array; this one may ("stop") or not ("length")
    workload = StructuredWorkload(0.5, {"type": "array", "items": {"type": "integer"}})
    out = run_offline(engine, reqs, progress=False, structured=workload, keep_outputs=True)
    report = out["structured"]
    assert report["fraction"] == 0.5 and report["schema"] == workload.schema
    assert report["requests"] == 2
    reasons = report["finish_reasons"]
    assert reasons["unconstrained"] == {"length": 2}
    assert sum(reasons["constrained"].values()) == 2
    assert set(reasons["constrained"]) <= {"stop", "length"}
    stopped = 0
    for constrained, ids, req in zip(structured_rows(4, 0.5), out["outputs"], reqs):
        text = smollm2.tokenizer.decode(ids)
        if not constrained:
            assert len(ids) == req.output_len
        elif len(ids) < req.output_len:  # the grammar completed: a whole array
            value = json.loads(text)
            assert isinstance(value, list) and all(isinstance(v, int) for v in value)
            stopped += 1
        else:
            assert ARRAY_PREFIX.fullmatch(text), text
    assert reasons["constrained"].get("stop", 0) == stopped
    assert out["compiles_during_run"] == 0
