"""Tensor-parallel checks on 8 fake CPU devices, run in their own process by test_tp.py
(the device count must be set before JAX starts, and the other tests expect one device).

    python tests/tp_worker.py CASE [ARGS]   -> one JSON line on stdout
"""
from __future__ import annotations

import json
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

PROMPTS = [[1, 5, 9, 33, 7], [100, 200, 300], list(range(40, 60))]  # one 32-token prefill


def _penalized():
    """Greedy with every logit-processing input (applied to the vocab-sharded logits)."""
    from nanojax.engine.sampling import SamplingParams
    return SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3,
                          frequency_penalty=0.4, presence_penalty=0.3,
                          logit_bias={3: 0.05, 300: -0.05, 511: 0.08})


def _tokens(llm_or_engine, prompts, params):
    from nanojax.engine.llm import LLM
    if isinstance(llm_or_engine, LLM):
        outs = llm_or_engine.generate(prompts, params, use_tqdm=False)
    else:
        ids = [llm_or_engine.add_request(p, params) for p in prompts]
        done = llm_or_engine.run_to_completion()
        outs = [done[i] for i in ids]
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _sharded_bytes(params, tp):
    """(bytes on device 0, whole bytes) of the arrays that are split over the mesh."""
    import jax
    import numpy as np
    mine = whole = 0
    for x in jax.tree_util.tree_leaves(params):
        if "tp" not in [a for a in x.sharding.spec if a]:
            continue
        whole += x.size * x.dtype.itemsize
        mine += sum(s.data.size * s.data.dtype.itemsize for s in x.addressable_shards
                    if s.device == x.sharding.mesh.devices.flat[0])
        assert np.prod(x.sharding.shard_shape(x.shape)) * tp == x.size
    return mine, whole


def case_tiny():
    """Greedy (with logprobs) and seeded top-k/top-p sampling at TP 1, 2, 4; per-device
    bytes; every ablation mode of a plan with network nano-ops at TP 2."""
    from nanojax.engine.llm import LLM
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.sampling import SamplingParams
    from checkpoints.loader import load_model
    from nanojax.pipeline.executor import PipelineForward
    from nanojax.pipeline.plan import MODES
    from nanojax.engine import sampling
    # sampling and logprobs in blocks of at most 3 rows (sampling.in_row_blocks' loop, and
    # a remainder for the scored prompts) on the vocab-sharded logits, as in blocks at
    # 2,048 rows x 128k on a GPU
    sampling.SAMPLER_BLOCK_BYTES = 3 * 4 * load_model("random:tiny").config.vocab_size
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    out = {"greedy": {}, "sampled": {}, "bytes": {}, "modes": {}, "top_logprobs": {}}
    kw = dict(dtype="float32", num_pages=64, b_dense=32)
    for tp in (1, 2, 4):
        llm = LLM("random:tiny", tensor_parallel_size=tp, **kw)
        toks, lps = _tokens(llm, PROMPTS, greedy)
        out["greedy"][tp] = toks
        out["top_logprobs"][tp] = [[t[1] for t in lps[0][0]["top"]]]
        out["sampled"][tp] = _tokens(llm, PROMPTS, sampled)[0]
        out.setdefault("penalized", {})[tp] = _tokens(llm, PROMPTS, _penalized())[0]
        scored = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0,
                                                      prompt_logprobs=2), use_tqdm=False)
        out.setdefault("prompt_logprobs", {})[tp] = [  # scored from vocab-sharded logits
            [(e["logprob"], e["rank"], [i for i, _ in e["top"]]) for e in o.prompt_logprobs[1:]]
            for o in scored]
        if tp > 1:
            out["bytes"][tp] = _sharded_bytes(llm.engine.runner.params, tp)
            out["bytes"][f"{tp}_kv"] = _sharded_bytes(llm.engine.runner.kv, tp)
        del llm
    bundle = load_model("random:tiny", dtype="float32", tensor_parallel_size=2)
    plan = json.loads(sys.argv[2])
    for mode in MODES:
        fwd = PipelineForward(bundle.config, plan, mode, tp=2)
        eng = LLMEngine(bundle, EngineConfig(num_pages=64, b_dense=32,
                                             tensor_parallel_size=2), forward=fwd)
        out["modes"][mode] = _tokens(eng, PROMPTS, greedy)[0]
    return out


def case_qwen3():
    """Qwen3's per-head q/k norms (scales away from their init of ones) under TP 2 and 4
    (KV heads replicated at 4): TP 1's greedy tokens."""
    import numpy as np

    from checkpoints.loader import load_model
    from nanojax.engine.llm import LLM
    from nanojax.engine.llm_engine import EngineConfig
    from nanojax.engine.sampling import SamplingParams
    bundle = load_model("random:tiny-qwen3", dtype="float32")
    params = bundle.params["params"]
    for i in range(bundle.config.num_layers):
        for k, norm in enumerate(("q_norm", "k_norm")):
            params[f"layers_{i}"][norm]["scale"] = np.linspace(
                0.2 + k, 2.0, bundle.config.head_dim, dtype=np.float32)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    out = {}
    for tp in (1, 2, 4):
        llm = LLM(bundle, config=EngineConfig(tensor_parallel_size=tp, num_pages=64,
                                              b_dense=32))
        out[tp] = _tokens(llm, PROMPTS, greedy)[0]
        del llm
    return out


def case_smollm2():
    """SmolLM2 (9 heads, 3 KV heads) at TP 3 against TP 1, from the host weights."""
    from checkpoints.loader import load_model
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.sampling import SamplingParams
    bundle = load_model("smollm2-135m", dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [bundle.tokenizer.encode(p) for p in ("The capital of France is",
                                                     "def fibonacci(n):")]
    out = {}
    for tp in (1, 3):
        eng = LLMEngine(bundle, EngineConfig(num_pages=32, b_dense=64, max_model_len=256,
                                             tensor_parallel_size=tp))
        out[tp] = _tokens(eng, prompts, params)[0]
    return out


def case_orbax():
    """A checkpoint restored straight into its TP 2 shards equals the host restore."""
    import jax
    import numpy as np
    from checkpoints.loader import load_model
    path = sys.argv[2]
    host = load_model(path)
    sharded = load_model(path, tensor_parallel_size=2)
    same = jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
        host.params, sharded.params))
    q = sharded.params["params"]["layers_0"]["q_proj"]["kernel"]
    return {"same": same, "q_spec": [a for a in q.sharding.spec],
            "q_shard": list(q.sharding.shard_shape(q.shape)), "q_shape": list(q.shape)}


def case_orbax_fp8():
    """An FP8 checkpoint restored into its TP 2 shards equals the host restore; one with a
    NaN scale is refused by name, checked on the devices."""
    import jax
    import numpy as np
    from checkpoints.loader import load_model
    from nanojax.errors import CheckpointError
    sharded = load_model(sys.argv[2], tensor_parallel_size=2)
    same = jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))),
        load_model(sys.argv[2]).params, sharded.params))
    try:
        load_model(sys.argv[3], tensor_parallel_size=2)
        error = "no error"
    except CheckpointError as e:
        error = str(e)
    return {"same": same, "error": error}


def case_errors():
    from checkpoints.loader import load_model
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.errors import ConfigError
    bundle = load_model("random:tiny", dtype="float32")
    out = {}
    for tp in (3, 4, 0):
        try:
            LLMEngine(bundle, EngineConfig(num_pages=64, b_dense=32, tensor_parallel_size=tp))
            out[tp] = "no error"
        except ConfigError as e:
            out[tp] = str(e)
    return out


def case_profile():
    """The profiler at TP 2 (one shard's ops, the all-reduces over 2 devices) feeds the
    search, whose plan carries the network nano-ops."""
    from checkpoints.loader import load_model
    from nanojax.pipeline.plan import validate
    from search.milp import Profile, search, to_plan
    from search.profiler import run_profile
    bundle = load_model("random:tiny", dtype="float32")
    raw = run_profile(bundle, 32, 16, "24/8", shares=(1.0,), iters=2, progress=False,
                      num_pages=64, tp=2)
    prof = Profile.from_dict(json.loads(json.dumps(raw)))
    plan = validate(to_plan(prof, search(prof, max_k=2, time_limit=10), raw["model"], 2))
    return {"groups": list(prof.groups), "net": raw["ops"]["o_allreduce"]["times"],
            "plan_groups": sorted(plan["nano_batches"]), "tp": plan["tp"]}


def case_mp():
    """One of 2 processes x 2 devices (gloo): TP 4 over both; process 0 schedules."""
    import argparse
    from checkpoints.loader import load_model
    from nanojax.engine.llm_engine import EngineConfig, LLMEngine
    from nanojax.engine.sampling import SamplingParams
    from nanojax.parallel.multihost import init_distributed, is_leader
    pid, port = int(sys.argv[2]), sys.argv[3]
    init_distributed(argparse.Namespace(coordinator_address=f"127.0.0.1:{port}",
                                        num_processes=2, process_id=pid))
    bundle = load_model("random:tiny", dtype="float32", tensor_parallel_size=4)
    eng = LLMEngine(bundle, EngineConfig(num_pages=64, b_dense=32, tensor_parallel_size=4))
    if not is_leader():
        return {"followed_steps": eng.runner.follow()}
    toks = _tokens(eng, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))[0]
    penalized = _tokens(eng, PROMPTS, _penalized())[0]  # steps with more inputs
    eng.runner.stop_followers()
    return {"tokens": toks, "penalized": penalized, "steps": eng.stats.steps}


if __name__ == "__main__":
    res = globals()["case_" + sys.argv[1]]()
    print("RESULT " + json.dumps(res))
