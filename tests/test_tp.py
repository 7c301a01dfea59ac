"""Tensor parallelism on 8 fake CPU devices (tests/tp_worker.py, in a subprocess): every TP
degree and every ablation mode gives TP 1's tokens; weights and KV pages are split 1/TP;
bad TP sizes get clear errors; the server at TP 2 answers the openai client."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanojax.config import named_shape
from nanojax.pipeline.plan import PlanError, TP_GROUPS, ablation, validate

ROOT = Path(__file__).resolve().parents[1]


def _env(devices: int = 8) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _worker(*args, devices=8, timeout=600) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_worker.py"), *args],
                       capture_output=True, text=True, timeout=timeout, env=_env(devices),
                       cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def tp_plan(b_dense: int = 32, tp: int = 2) -> dict:
    """Two nano-batches per group with the network nano-ops on stream 3."""
    cfg = named_shape("tiny")
    ops = []
    for k in (0, 1):
        ops += [{"op": "qkv", "batch": k}, {"op": "attention", "batch": k, "stream": 1},
                {"op": "o_proj", "batch": k}, {"op": "o_allreduce", "batch": k, "stream": 3},
                {"op": "mlp", "batch": k}, {"op": "mlp_allreduce", "batch": k, "stream": 3}]
    half = b_dense // 2
    return validate({"version": 1, "model": cfg.signature(), "tp": tp, "b_dense": b_dense,
                     "nano_batches": {g: [[0, half], [half, b_dense]] for g in TP_GROUPS},
                     "nano_ops": ops})


@pytest.fixture(scope="module")
def tiny():
    return _worker("tiny", json.dumps(tp_plan()))


@pytest.mark.slow
def test_tp_tokens_equal_tp1(tiny):
    g = tiny["greedy"]
    assert g["1"] == g["2"] == g["4"]
    assert tiny["sampled"]["1"] == tiny["sampled"]["2"] == tiny["sampled"]["4"]
    # penalties and logit_bias on the vocab-sharded logits: the same tokens, and they bite
    pen = tiny["penalized"]
    assert pen["1"] == pen["2"] == pen["4"] and pen["1"] != g["1"]
    lp = tiny["top_logprobs"]
    for tp in ("2", "4"):
        assert lp[tp][0] == pytest.approx(lp["1"][0], abs=1e-5)
    scored = tiny["prompt_logprobs"]  # each prompt token after the first, at every TP
    assert [len(p) for p in scored["1"]] == [4, 2, 19]
    for tp in ("2", "4"):
        for mine, one in zip(scored[tp], scored["1"]):
            assert [e[0] for e in mine] == pytest.approx([e[0] for e in one], abs=1e-5)
            # ranks and top ids: equal but where sharded sums reorder a near tie
            assert all(abs(a[1] - b[1]) <= 1 for a, b in zip(mine, one))
            assert sum(a[2] != b[2] for a, b in zip(mine, one)) <= 1


@pytest.mark.slow
def test_qwen3_qk_norms_under_tp_give_tp1_tokens():
    out = _worker("qwen3")
    assert out["1"] == out["2"] == out["4"]
    assert len({tuple(t) for t in out["1"]}) > 1  # the prompts' continuations differ


@pytest.mark.slow
def test_every_mode_equal_under_tp(tiny):
    for mode, toks in tiny["modes"].items():
        assert toks == tiny["greedy"]["1"], mode


@pytest.mark.slow
def test_per_device_bytes_are_one_over_tp(tiny):
    for tp in (2, 4):
        mine, whole = tiny["bytes"][str(tp)]
        assert whole > 0 and mine * tp == whole
        mine, whole = tiny["bytes"][f"{tp}_kv"]
        assert mine * tp == whole


@pytest.mark.slow
def test_two_processes_equal_one(tiny):
    """2 processes x 2 CPU devices on localhost (jax.distributed, gloo collectives), TP 4
    over both: process 0 schedules and broadcasts each step; the tokens equal TP 1's."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "tp_worker.py"), "mp",
                               str(pid), port], env=_env(2), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for pid in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, err[-3000:]
        outs.append(json.loads(lines[-1][len("RESULT "):]))
    assert outs[0]["tokens"] == tiny["greedy"]["1"]
    assert outs[0]["penalized"] == tiny["penalized"]["1"]
    assert outs[1]["followed_steps"] == outs[0]["steps"] > 0


def test_smollm2_tp3_equals_tp1():
    out = _worker("smollm2")
    assert out["1"] == out["3"] and len(out["1"][0]) == 8


def test_orbax_restores_into_shards(tmp_path):
    from checkpoints.loader import load_model
    from checkpoints.orbax_store import save_orbax
    save_orbax(load_model("random:tiny", dtype="float32"), tmp_path / "ck")
    out = _worker("orbax", str(tmp_path / "ck"))
    assert out["same"]
    assert out["q_spec"] == [None, "tp"] and out["q_shard"][1] * 2 == out["q_shape"][1]


def test_fp8_orbax_restores_into_shards_and_is_value_checked_there(tmp_path):
    import dataclasses

    import jax
    import numpy as np

    from checkpoints.loader import load_model
    from checkpoints.orbax_store import save_orbax
    fp8 = load_model("random:tiny", dtype="float32", quantization="fp8")
    save_orbax(fp8, tmp_path / "ck")
    bad = jax.tree_util.tree_map(np.array, fp8.params)
    bad["params"]["layers_1"]["up_proj"]["weight_scale"][7] = np.nan
    save_orbax(dataclasses.replace(fp8, params=bad), tmp_path / "bad")
    out = _worker("orbax_fp8", str(tmp_path / "ck"), str(tmp_path / "bad"), devices=2)
    assert out["same"]
    assert "['layers_1']['up_proj']['weight_scale'] holds 1 value" in out["error"]
    assert "flat index 7: nan" in out["error"]


def test_bad_tp_sizes_are_refused():
    out = _worker("errors", devices=2)
    assert "num_heads (4) is not divisible by tensor_parallel_size (3)" in out["3"]
    assert "needs 4 devices; 2 cpu device(s) available" in out["4"]
    assert "positive" in out["0"]


def test_profiler_measures_network_ops_for_the_search():
    out = _worker("profile", devices=2)
    assert out["groups"] == list(TP_GROUPS) and out["tp"] == 2
    assert sorted(out["plan_groups"]) == sorted(TP_GROUPS)
    assert all(t > 0 for t in out["net"].values()) and len(out["net"]) == 2


def test_network_ops_need_tp_and_ablate():
    plan = tp_plan()
    bad = dict(plan, tp=1)
    with pytest.raises(PlanError, match="need tp > 1"):
        validate(bad)
    non = ablation(plan, "non-overlap")
    assert [op["op"] for op in non["nano_ops"]] == list(TP_GROUPS)
    assert {op["stream"] for op in ablation(plan, "nanobatch-only")["nano_ops"]} == {0}


def test_server_tp2_answers_openai_client(tmp_path, smollm2):
    """A tiny random model with SmolLM2's tokenizer, saved as an orbax checkpoint, served at
    TP 2 (restored into its shards): the openai client's completion equals TP 1 offline."""
    openai = pytest.importorskip("openai")
    from checkpoints.orbax_store import save_orbax
    from nanojax.engine.llm import LLM
    from nanojax.engine.sampling import SamplingParams
    from nanojax.models import init_params
    from nanojax.models.bundle import ModelBundle
    cfg = named_shape("tiny").replace(vocab_size=smollm2.config.vocab_size,
                                      eos_token_ids=smollm2.config.eos_token_ids)
    ck = save_orbax(ModelBundle(cfg, init_params(cfg), smollm2.tokenizer), tmp_path / "ck")
    want = LLM(str(ck), num_pages=64, b_dense=32).generate(
        "Hello there", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanojax", "serve", "--model", str(ck),
                             "--tensor-parallel-size", "2", "--port", str(port),
                             "--num-pages", "64", "--b-dense", "32", "--no-access-log"],
                            env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        deadline = time.time() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
                time.sleep(0.5)
        r = client.completions.create(model=str(ck), prompt="Hello there", max_tokens=6,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text
        assert r.usage.completion_tokens == len(want.token_ids)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
