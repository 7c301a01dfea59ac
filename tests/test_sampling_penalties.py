"""presence / frequency / repetition penalties and logit_bias (vLLM semantics), on the
device: the pass against a numpy reference, and the engine, with async scheduling (where a
decode's last generated token is still on the device) and without, against a greedy loop
over the reference model's logits."""
import jax
import numpy as np
import pytest

from nanojax.engine.sampling import (Penalties, SamplingError, SamplingParams,
                                     apply_penalties, penalty_inputs, sample, with_pending)


def _np_penalize(logits, prompt, output, p: SamplingParams):
    """vLLM's apply_penalties, written out for one row."""
    x = np.array(logits, np.float64)
    for t, b in p.logit_bias.items():
        x[t] += b
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.asarray(output, int), minlength=len(x)) if output else \
        np.zeros(len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalty_pass_matches_numpy_reference():
    rng = np.random.default_rng(0)
    vocab, rows = 50, 5
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(),  # a row that asks for nothing stays exactly as it was
              SamplingParams(repetition_penalty=1.8, logit_bias={3: 5.0, 49: -100}),
              SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.0,
                             presence_penalty=2.0, logit_bias={0: 1.5}),
              SamplingParams(logit_bias={7: 100})]
    hist = [(rng.integers(0, vocab, 6).tolist(), rng.integers(0, vocab, 9).tolist())
            for _ in range(rows)]
    hist[0] = ([1, 2], [4, 4, 4, 9])  # repeated outputs: frequency counts them
    pending = np.array([4, 11, 0, 5, 0], np.int32)  # rows 0 and 3: a sample on the device
    valid = np.array([True, False, False, True, False])
    pen = penalty_inputs([(p, pr, out) for p, (pr, out) in zip(params, hist)], 8, vocab)
    pen = Penalties(*(np.asarray(a)[:rows] for a in pen))  # the pass runs on logits rows
    got = np.asarray(jax.jit(lambda x, p, t, v: apply_penalties(x, with_pending(p, t, v)))(
        logits, pen, pending, valid))
    for r, p in enumerate(params):
        prompt, out = hist[r]
        out = out + [int(pending[r])] if valid[r] else out
        np.testing.assert_allclose(got[r], _np_penalize(logits[r], prompt, out, p),
                                   rtol=1e-5, atol=1e-4)
    assert (got[1] == logits[1]).all()
    assert penalty_inputs([(SamplingParams(), [1], [2])], 4, vocab) is None  # fast path


def test_greedy_and_logprobs_follow_the_bias():
    logits = np.zeros((2, 32), np.float32)
    logits[:, 2] = 1.0
    pen = penalty_inputs([(SamplingParams(logit_bias={7: 50}), [1], []),
                          (SamplingParams(), [1], [])], 2, 32)
    toks, chosen, _, _ = jax.jit(sample)(logits, np.zeros(2, np.float32), np.ones(2, np.float32),
                                np.full(2, -1, np.int32), np.zeros(2, np.uint32),
                                np.zeros(2, np.int32),
                                with_pending(pen, np.zeros(2, np.int32), np.zeros(2, bool)))
    assert np.asarray(toks).tolist() == [7, 2]
    # log-probabilities stay the model's (vLLM's default), before the bias
    assert float(chosen[0]) == pytest.approx(float(chosen[1]) - 1.0, abs=1e-5)


def test_min_p_keeps_tokens_near_the_likeliest_and_top_p_counts_what_it_kept():
    """vLLM's order: min_p on the tempered probabilities, then top-p over what is left.
    Probabilities 0.5 / 0.3 / 0.15 / 0.05: min_p 0.35 keeps tokens >= 0.175 (0, 1); top_p
    0.83 keeps token 2 alone (0.8 before it), not after min_p 0.2 has dropped token 3
    (0.842 before it, renormalised)."""
    import functools

    import jax.numpy as jnp
    rows = 256
    logits = jnp.tile(jnp.log(jnp.asarray([0.5, 0.3, 0.15, 0.05], jnp.float32)), (rows, 1))
    seeds, steps = jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32)

    def drawn(min_p, top_p=1.0):
        return set(np.asarray(jax.jit(functools.partial(sample, logprobs=False))(
            logits, jnp.ones(rows), jnp.full(rows, top_p), jnp.full(rows, -1), seeds, steps,
            min_p=jnp.full(rows, min_p))[0]).tolist())
    assert drawn(0.0) == {0, 1, 2, 3}
    assert drawn(0.35) == {0, 1}
    assert drawn(1.0) == {0}
    assert drawn(0.0, top_p=0.83) == {0, 1, 2}
    assert drawn(0.2, top_p=0.83) == {0, 1}


@pytest.mark.parametrize("kw", [dict(presence_penalty=float("nan")),
                                dict(frequency_penalty=2.5), dict(repetition_penalty=0.0),
                                dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}),
                                dict(top_k=2**31), dict(temperature=float("inf")),
                                dict(min_p=1.5), dict(min_p=-0.1)])
def test_bad_sampling_params_are_refused(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_penalties_match_a_reference_greedy_loop(tiny_bundle, async_scheduling):
    import jax.numpy as jnp

    from nanojax.engine.llm_engine import EngineConfig, LLMEngine, RequestError
    from nanojax.layers.attention import (ContiguousMetadata, contiguous_attention,
                                          init_contiguous_cache)
    from nanojax.models import LlamaForCausalLM

    cfg, width = tiny_bundle.config, 32
    model = LlamaForCausalLM(cfg)

    @jax.jit
    def all_logits(tokens):  # causal: padding after a position does not change its logits
        cache = init_contiguous_cache(cfg, width + 1, jnp.dtype(cfg.dtype))
        meta = ContiguousMetadata(positions=jnp.arange(width, dtype=jnp.int32))
        return model.apply(tiny_bundle.params, tokens, cache, meta, contiguous_attention)[0]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11, 3)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                             repetition_penalty=1.5, frequency_penalty=0.5,
                             presence_penalty=0.5, logit_bias={int(prompts[0][0]): 2.0}),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                             frequency_penalty=2.0)]

    def reference(prompt, p):
        out = []
        for _ in range(p.max_tokens):
            ctx = prompt + out
            logits = np.asarray(all_logits(np.pad(np.int32(ctx), (0, width - len(ctx)))))
            logits = logits[len(ctx) - 1]
            out.append(int(np.argmax(_np_penalize(logits, prompt, out, p))))
        return out

    eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=32, max_model_len=64,
                                              async_scheduling=async_scheduling))
    ids = [eng.add_request(pr, p) for pr, p in zip(prompts, params)]
    done = eng.run_to_completion()
    for rid, pr, p in zip(ids, prompts, params):
        assert done[rid].token_ids == reference(pr, p)
    with pytest.raises(RequestError, match="logit_bias"):
        eng.add_request([1, 2], SamplingParams(logit_bias={cfg.vocab_size: 1.0}))
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_engine_min_p_one_samples_the_greedy_tokens(tiny_bundle):
    """min_p reaches the device per row: at min_p 1 only the likeliest token survives, so a
    sampled row (temperature 1) follows the greedy one beside it in the same batch."""
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=32, max_model_len=64))
    prompt = [3, 14, 15, 92, 65]
    greedy = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True))
    minp = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0,
                                                  seed=3, ignore_eos=True))
    free = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=5.0, seed=3,
                                                  ignore_eos=True))
    done = eng.run_to_completion()
    assert done[minp].token_ids == done[greedy].token_ids
    assert done[free].token_ids != done[greedy].token_ids  # sampling is on in that batch


def test_the_sampler_holds_no_device_conditional_and_rows_do_not_depend_on_each_other():
    """On a GPU, XLA runs a conditional by copying its predicate to the host and waiting
    for the device: a cond in the step made dispatch wait for every step. The greedy or
    sampling path is chosen on the host instead, and a row's top-p mask no longer depends
    on whether another row of the batch asked for one."""
    import jax.numpy as jnp
    from nanojax.engine.sampling import any_sampling, sample
    rng = np.random.default_rng(0)
    r, v = 4, 64
    logits = jnp.asarray(rng.standard_normal((r, v)) * 3, jnp.float32)
    temperature = jnp.asarray([0.0, 1.0, 0.7, 1.0], jnp.float32)
    top_k = jnp.asarray([-1, -1, 5, -1], jnp.int32)
    seeds, steps = jnp.arange(r, dtype=jnp.uint32), jnp.zeros(r, jnp.int32)
    for sampling in (False, True):
        jaxpr = str(jax.make_jaxpr(lambda *a: sample(*a, sampling=sampling))(
            logits, temperature, jnp.ones(r), top_k, seeds, steps))
        assert "cond[" not in jaxpr and "while[" not in jaxpr
    assert any_sampling(np.asarray(temperature)) and not any_sampling(np.zeros(3))
    greedy = sample(logits, jnp.zeros(r), jnp.ones(r), top_k, seeds, steps, sampling=False)
    assert np.array_equal(greedy[0], np.argmax(np.asarray(logits), -1))
    both = sample(logits, temperature, jnp.ones(r), top_k, seeds, steps)[0]
    alone = sample(logits, temperature, jnp.ones(r), jnp.full(r, -1), seeds, steps)[0]
    # rows 0, 1, 3 ask for no filter: the same token whether or not row 2 filters
    assert np.array_equal(np.asarray(both)[[0, 1, 3]], np.asarray(alone)[[0, 1, 3]])
    assert int(both[0]) == int(np.argmax(np.asarray(logits)[0]))
    assert int(both[2]) in np.argsort(np.asarray(logits)[2])[-5:]  # within its top 5


def test_a_batch_without_logprobs_skips_the_top_k_sort_and_keeps_its_tokens():
    """The top-20 logprobs are a full sort of every row on a GPU (~9 ms an iteration at
    1,026 rows x 128k on the H200): a step none of whose rows asks for logprobs (host
    flag, static) holds no top_k / sort and samples the same tokens."""
    import jax.numpy as jnp
    from nanojax.engine.sampling import any_logprobs, sample
    rng = np.random.default_rng(1)
    r, v = 4, 64
    logits = jnp.asarray(rng.standard_normal((r, v)) * 3, jnp.float32)
    temperature = jnp.asarray([0.0, 1.0, 0.0, 0.8], jnp.float32)
    top_p, top_k = jnp.ones(r), jnp.full(r, -1, jnp.int32)
    seeds, steps = jnp.arange(r, dtype=jnp.uint32), jnp.zeros(r, jnp.int32)
    args = (logits, temperature, top_p, top_k, seeds, steps)
    bare = str(jax.make_jaxpr(lambda *a: sample(*a, logprobs=False, sampling=False))(*args))
    assert "top_k" not in bare and "sort" not in bare
    assert "top_k" in str(jax.make_jaxpr(lambda *a: sample(*a, logprobs=True))(*args))
    without = sample(*args, logprobs=False)
    full = sample(*args, logprobs=True)
    assert np.array_equal(without[0], full[0])
    assert without[2].shape == (r, 0) and without[3].shape == (r, 0)
    lp = np.asarray(jax.nn.log_softmax(logits, -1))
    chosen = lp[np.arange(r), np.asarray(full[0])]
    np.testing.assert_allclose(full[1], chosen, rtol=1e-6)
    assert any_logprobs(np.array([False, True])) and not any_logprobs(np.zeros(3, bool))


def test_logprobs_in_a_batch_that_mostly_does_not_ask(tiny_bundle):
    """The engine picks the sampler's logprobs variant per step: a request asking for
    logprobs beside others that do not gets the model's logprobs; the others' tokens are
    those of a run where nobody asked."""
    from nanojax.config import EngineConfig
    from nanojax.engine.llm_engine import LLMEngine
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]

    def run(asks):
        eng = LLMEngine(tiny_bundle, EngineConfig(b_dense=32, num_pages=32, max_model_len=64))
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_tokens=5, temperature=0.0,
                                              logprobs=3 if i in asks else None),
                            request_id=str(i))
        return {k: o.outputs[0] for k, o in eng.run_to_completion().items()}

    plain, mixed = run(set()), run({1})
    for i in "012":
        assert plain[i].token_ids == mixed[i].token_ids
    lps = mixed["1"].logprobs
    assert len(lps) == 5 and all(len(e["top"]) == 3 and e["logprob"] <= 0 for e in lps)
    assert all(e["top"][0][1] >= e["logprob"] - 1e-5 for e in lps)
    assert not plain["0"].logprobs


def test_sampling_runs_in_row_blocks_with_the_same_tokens_and_a_blocks_memory(monkeypatch):
    """At 2,048 rows x 128k the sampling path's sort, softmax, cumsum and noise took 6.85
    GiB (an H100 ran out of memory, fp8.md §91): it now draws in blocks of rows, one after
    another. A row's token is the same in any block, and the compiled sampler's scratch
    memory is a block's, not the batch's."""
    import jax.numpy as jnp
    from nanojax.engine import sampling
    rng = np.random.default_rng(2)
    r, v = 41, 512
    logits = jnp.asarray(rng.standard_normal((r, v)) * 3, jnp.float32)
    temperature = jnp.asarray(rng.uniform(0.0, 1.5, r), jnp.float32).at[::7].set(0.0)
    top_p = jnp.asarray(np.where(np.arange(r) % 3 == 0, 0.8, 1.0), jnp.float32)
    top_k = jnp.asarray(np.where(np.arange(r) % 4 == 1, 20, -1), jnp.int32)
    min_p = jnp.asarray(np.where(np.arange(r) % 5 == 2, 0.1, 0.0), jnp.float32)
    seeds, steps = jnp.arange(r, dtype=jnp.uint32), jnp.arange(r, dtype=jnp.int32)
    args = (logits, temperature, top_p, top_k, seeds, steps)
    one_block = sampling.sample(*args, logprobs=False, min_p=min_p)[0]
    # at most 9 rows a block: 5 equal blocks of 9 (41 rows), four through the loop and a
    # remainder of 5; at most 10: 5 blocks of 9 again; 41: one block (no loop)
    assert sampling.sampler_block_rows(r, v, 9 * 4 * v) == 9
    assert sampling.sampler_block_rows(r, v, 10 * 4 * v) == 9
    assert sampling.sampler_block_rows(0, v) == 1  # (no rows: no division by zero)
    for block_rows in (9, 4, 1):
        monkeypatch.setattr(sampling, "SAMPLER_BLOCK_BYTES", block_rows * 4 * v)
        blocked = sampling.sample(*args, logprobs=False, min_p=min_p)[0]
        assert np.array_equal(np.asarray(blocked), np.asarray(one_block)), block_rows
    jaxpr = str(jax.make_jaxpr(lambda *a: sampling.sample(*a, logprobs=False))(*args))
    assert "cond[" not in jaxpr  # the loop has a known trip count: no predicate read back

    def scratch(block_bytes, rows=512, vocab=32768):
        monkeypatch.setattr(sampling, "SAMPLER_BLOCK_BYTES", block_bytes)
        shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
            ((rows, vocab), jnp.float32), ((rows,), jnp.float32), ((rows,), jnp.float32),
            ((rows,), jnp.int32), ((rows,), jnp.uint32), ((rows,), jnp.int32))]
        compiled = jax.jit(lambda *a: sampling.sample(*a, logprobs=False)).lower(
            *shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    batch = 512 * 32768 * 4
    whole, blocks = scratch(1 << 40), scratch(batch // 8)
    assert whole > 3 * batch and blocks < batch, (whole, blocks)


def test_logprobs_run_in_row_blocks_with_the_same_values_and_a_blocks_memory(monkeypatch):
    """The logprobs path (a log-softmax of every row and a top-20 sort) is in row blocks
    too: at 2,048 rows x 128k its buffers were several GB beside the logits. Values, ids
    and ranks are the same in any blocking, and the scratch is a block's."""
    import jax.numpy as jnp
    from nanojax.engine import sampling
    rng = np.random.default_rng(3)
    r, v = 41, 512
    logits = jnp.asarray(rng.standard_normal((r, v)) * 3, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, r), jnp.int32)
    whole = sampling.token_logprobs(logits, tokens, rank=True)
    for block_rows in (9, 4, 1):
        monkeypatch.setattr(sampling, "SAMPLER_BLOCK_BYTES", block_rows * 4 * v)
        blocked = sampling.token_logprobs(logits, tokens, rank=True)
        # ids and ranks exactly; values to float32's rounding (XLA's loops over a block's
        # vocabulary may sum in another order than over the batch's)
        for i, (a, b) in enumerate(zip(whole, blocked)):
            if i in (1, 2):
                assert np.array_equal(np.asarray(a), np.asarray(b)), block_rows
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    ref = jax.nn.log_softmax(logits, axis=-1)  # an independent check of the values
    np.testing.assert_allclose(np.asarray(whole[0]),
                               np.asarray(ref[jnp.arange(r), tokens]), rtol=1e-6)

    def scratch(block_bytes, rows=512, vocab=32768):
        monkeypatch.setattr(sampling, "SAMPLER_BLOCK_BYTES", block_bytes)
        shapes = [jax.ShapeDtypeStruct((rows, vocab), jnp.float32),
                  jax.ShapeDtypeStruct((rows,), jnp.int32)]
        compiled = jax.jit(lambda *a: sampling.token_logprobs(*a)).lower(*shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    batch = 512 * 32768 * 4
    full, blocks = scratch(1 << 40), scratch(batch // 8)
    assert full >= batch and blocks < batch / 2, (full, blocks)


def test_penalties_and_grammar_masks_run_in_the_row_blocks(monkeypatch):
    """Penalties and grammar masks each made a whole [rows, vocab] copy of the logits or
    more (counts, seen flags, unpacked bits: GBs at 2,048 rows x 128k) before the blocked
    draw: they now run inside its row blocks. Tokens are the same in any blocking, greedy
    rows equal an independent argmax of the processed logits, masked rows draw only
    allowed tokens, and the compiled sampler's scratch is a block's."""
    import jax.numpy as jnp
    from nanojax.engine import sampling
    from nanojax.engine.structured import GrammarMasks
    rng = np.random.default_rng(5)
    r, v, hist = 41, 512, 6
    logits = jnp.asarray(rng.standard_normal((r, v)) * 3, jnp.float32)
    temperature = jnp.asarray(rng.uniform(0.3, 1.5, r), jnp.float32).at[::3].set(0.0)
    top_p, top_k = jnp.full((r,), 0.9, jnp.float32), jnp.full((r,), -1, jnp.int32)
    seeds, steps = jnp.arange(r, dtype=jnp.uint32), jnp.arange(r, dtype=jnp.int32)
    pen = sampling.Penalties(
        token_ids=jnp.asarray(rng.integers(0, v + 1, (r, hist)), jnp.int32),  # v: padding
        is_output=jnp.asarray(rng.random((r, hist)) < 0.5),
        presence=jnp.asarray(rng.uniform(-1, 1, r), jnp.float32),
        frequency=jnp.asarray(rng.uniform(-1, 1, r), jnp.float32),
        repetition=jnp.asarray(rng.uniform(0.8, 1.6, r), jnp.float32),
        bias_ids=jnp.asarray(rng.integers(0, v, (r, 2)), jnp.int32),
        bias_values=jnp.asarray(rng.uniform(-5, 5, (r, 2)), jnp.float32))
    rows = np.array([0, 3, 9, 20, 40], np.int32)  # constrained rows: a quarter allowed
    words = rng.integers(0, 2**32, (len(rows), v // 32), dtype=np.uint64)
    words &= rng.integers(0, 2**32, words.shape, dtype=np.uint64)
    masks = GrammarMasks(mask=words.astype(np.uint32).view(np.int32), rows=rows)
    args = (logits, temperature, top_p, top_k, seeds, steps)

    def tokens():
        return np.asarray(sampling.sample(*args, penalties=pen, bitmask=masks,
                                          logprobs=False)[0])
    whole = tokens()
    for block_rows in (9, 4, 1):
        monkeypatch.setattr(sampling, "SAMPLER_BLOCK_BYTES", block_rows * 4 * v)
        assert np.array_equal(tokens(), whole), block_rows
    processed = np.asarray(sampling.apply_bitmask(sampling.apply_penalties(logits, pen),
                                                  masks.mask, masks.rows))
    greedy = np.asarray(temperature) == 0
    assert np.array_equal(whole[greedy], processed.argmax(-1)[greedy])
    assert np.isfinite(processed[np.arange(r), whole]).all()  # allowed tokens only

    def scratch(block_bytes, rows=512, vocab=32768):
        monkeypatch.setattr(sampling, "SAMPLER_BLOCK_BYTES", block_bytes)
        sd = jax.ShapeDtypeStruct
        per_row = [sd((rows, vocab), jnp.float32), sd((rows,), jnp.float32),
                   sd((rows,), jnp.float32), sd((rows,), jnp.int32), sd((rows,), jnp.uint32),
                   sd((rows,), jnp.int32)]
        p = sampling.Penalties(sd((rows, 64), jnp.int32), sd((rows, 64), jnp.bool_),
                               *[sd((rows,), jnp.float32)] * 3, sd((rows, 8), jnp.int32),
                               sd((rows, 8), jnp.float32))
        m = GrammarMasks(sd((16, vocab // 32), jnp.int32), sd((16,), jnp.int32))
        compiled = jax.jit(lambda a, p, m: sampling.sample(
            *a, penalties=p, bitmask=m, logprobs=False)).lower(per_row, p, m).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    # (on the CPU at these shapes: 8.3x the logits' bytes in one block, 1.07x in blocks of
    # 64 rows; before, with the penalties and masks outside the blocks, 3.3x)
    batch = 512 * 32768 * 4
    full, blocks = scratch(1 << 40), scratch(batch // 8)
    assert full > 6 * batch and blocks < 1.25 * batch, (full, blocks)
