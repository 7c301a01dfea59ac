"""prompt_logprobs (vLLM's; lm-eval's loglikelihood through echo): each prompt token's
log-probability given the ones before it, from the engine's own chunked steps, against the
one-request reference's logits over the whole prompt."""
import jax
import numpy as np
import pytest

from nanojax import SamplingParams
from nanojax.engine.llm_engine import EngineConfig, LLMEngine
from nanojax.reference import ReferenceGenerator


def _check(entries, prompt, ref_logits, k):
    """Every prompt token but the first scored as the reference scores it."""
    lp = np.asarray(jax.nn.log_softmax(ref_logits, axis=-1))
    assert entries[0] is None and len(entries) == len(prompt)
    for j, e in enumerate(entries[1:]):
        tok = prompt[j + 1]
        assert e["token_id"] == tok
        assert e["logprob"] == pytest.approx(lp[j, tok], abs=2e-4)
        # the rank: 1 + tokens strictly likelier (a token within float noise of it may
        # order either way)
        likelier = np.sum(lp[j] > lp[j, tok] + 1e-4), np.sum(lp[j] > lp[j, tok] - 1e-4)
        assert likelier[0] + 1 <= e["rank"] <= likelier[1] + 1
        assert len(e["top"]) == k
        top_ref = np.sort(lp[j])[::-1][:k]
        np.testing.assert_allclose([v for _, v in e["top"]], top_ref, atol=2e-4)
        assert all(lp[j, i] == pytest.approx(v, abs=2e-4) for i, v in e["top"])


def test_prompt_logprobs_match_reference(smollm2, monkeypatch):
    """Chunked prompts (B_dense 32), a step's cap on scored tokens (12 here: a long
    prompt's chunks shrink to it), a prompt the prefix cache holds (scored in full all the
    same), beside an unscored request; the generated tokens are the reference's, and every
    page comes back."""
    import nanojax.engine.runner as runner
    import nanojax.engine.scheduler as scheduler
    monkeypatch.setattr(scheduler, "MAX_SCORED_TOKENS", 12)
    monkeypatch.setattr(runner, "MAX_SCORED_TOKENS", 12)
    tok = smollm2.tokenizer
    long = tok.encode("The quick brown fox jumps over the lazy dog. " * 5)   # 51 tokens
    short = tok.encode("Paris is the capital of")
    ref = ReferenceGenerator(smollm2.config, smollm2.params, max_len=128)
    eng = LLMEngine(smollm2, EngineConfig(b_dense=32, num_pages=64, page_size=8,
                                          max_model_len=128, min_token_bucket=16,
                                          min_row_bucket=4))
    eng.add_request(long, SamplingParams(max_tokens=2, temperature=0))
    eng.run_to_completion()  # its full pages are in the prefix cache now
    assert eng.prefix_cache.match(_seq(long)).num_pages == len(long) // 8
    a = eng.add_request(long, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3))
    b = eng.add_request(short, SamplingParams(max_tokens=4, temperature=0))
    c = eng.add_request(short, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0,
                                              logprobs=1))
    scored_per_step = []
    schedule = eng.scheduler.schedule

    def counted(prev=None):
        batch = schedule(prev)
        scored_per_step.append(sum(len(e.seq.scored_positions(e.start, e.num_tokens))
                                   for e in batch.entries[batch.num_decodes:]))
        return batch

    eng.scheduler.schedule = counted
    done = eng.run_to_completion()
    assert max(scored_per_step) == 12 and sum(scored_per_step) == len(long) - 1 + len(short) - 1
    _check(done[a].prompt_logprobs, long, ref.logits(long), 3)
    _check(done[c].prompt_logprobs, short, ref.logits(short), 0)
    assert done[b].prompt_logprobs is None
    for rid, prompt in ((a, long), (b, short), (c, short)):
        assert done[rid].token_ids == ref.generate(prompt, 4, ignore_eos=True)
    assert len(done[c].outputs[0].logprobs) == 4
    assert eng.allocator.num_free == eng.allocator.num_pages


def _seq(ids):
    from nanojax.engine.sequence import Sequence
    return Sequence("probe", ids, SamplingParams())


def test_prompt_logprobs_params_are_checked():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
