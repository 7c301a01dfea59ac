"""The `nanojax` command line, run as a user would (subprocess)."""
import os
import json
import subprocess
import sys

import pytest


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "nanojax", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_json_greedy_matches_transformers(smollm2, hf_smollm2):
    torch = pytest.importorskip("torch")
    hf, _ = hf_smollm2
    prompt = "What is the capital of France?"
    res = run("generate", prompt, "--max-tokens", "32", "--temperature", "0", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)  # stdout holds exactly one JSON object
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                tokenize=True)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          eos_token_id=2)[0, len(ids):].tolist()
    assert out["token_ids"] == ref
    assert out["text"] == smollm2.tokenizer.decode(ref)
    assert "Paris" in out["text"]


def test_generate_raw_prompt_and_info(tmp_path):
    res = run("generate", "1, 2, 3, 4,", "--no-chat-template", "--max-tokens", "4",
              "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith("5")
    res = run("info", "random:llama3-8b")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["parameters"] == 8030261248


def test_cli_errors_name_the_problem(tmp_path):
    res = run("generate", "hi", "--model", str(tmp_path / "missing"))
    assert res.returncode == 2 and "unknown model" in res.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    res = run("convert", str(bad), str(tmp_path / "out"))
    assert res.returncode == 2 and "not a GGUF file" in res.stderr
    assert not (tmp_path / "out").exists()
    res = run("generate", "hi", "--max-tokens", "0")
    assert res.returncode == 2 and "positive integer" in res.stderr
    for bad in ("nan", "-1", "inf", "1e400", "0"):
        res = run("bench", "throughput", "--time-limit", bad)
        assert res.returncode == 2 and "seconds > 0" in res.stderr, (bad, res.stderr)


def test_compile_cache_is_on_by_default_and_can_be_moved_or_turned_off(tmp_path):
    cache = tmp_path / "jit"
    res = run("generate", "1, 2,", "--no-chat-template", "--max-tokens", "1",
              "--compile-cache-dir", str(cache))
    assert res.returncode == 0, res.stderr
    assert len(list(cache.rglob("*"))) > 5  # the step and the small programs around it
    off = tmp_path / "off"  # --no-compile-cache: nothing written, even where it would go
    code = ("import jax, jax.numpy as jnp\n"
            "from nanojax import compile_cache\n"
            "from nanojax.cli import build_parser\n"
            f"a = build_parser().parse_args(['generate', 'x', '--compile-cache-dir', '{off}',"
            " '--no-compile-cache'])\n"
            "assert compile_cache.configure(a) is None\n"
            "jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert not off.exists() or not list(off.rglob("*"))


def test_gpu_memory_utilization_sizes_jax_pool(monkeypatch):
    """--gpu-memory-utilization becomes jax's allocator share before the backend starts
    (jax's own 0.75 left a fifth of an H200's KV cache unused); a variable the user set
    wins; a bad share is refused before jax reads it; commands without a model are left
    alone."""
    from nanojax.cli import build_parser
    from nanojax.config_flags import apply_gpu_memory_utilization
    from nanojax.engine.kv_cache import MEM_FRACTION_ENV
    from nanojax.errors import ConfigError
    from jax._src import xla_bridge
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    for env in MEM_FRACTION_ENV:
        monkeypatch.delenv(env, raising=False)
    parse = build_parser().parse_args
    assert apply_gpu_memory_utilization(parse(["serve"])) == 0.9
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.9"
    assert apply_gpu_memory_utilization(
        parse(["bench", "throughput", "--gpu-memory-utilization", "0.8"])) == 0.9  # kept
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    assert apply_gpu_memory_utilization(
        parse(["bench", "throughput", "--gpu-memory-utilization", "0.8"])) == 0.8
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    with pytest.raises(ConfigError, match="must be in"):
        apply_gpu_memory_utilization(parse(["serve", "--gpu-memory-utilization", "nan"]))
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert apply_gpu_memory_utilization(parse(["serve"])) is None  # too late: not applied
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ


def test_kv_cache_keeps_to_the_memory_share_within_jax_pool(monkeypatch):
    """The KV cache's bytes: 0.9 of the engine's share of the card, within jax's pool
    (whose share the variable gives, or jax's 0.75), less what is in use; so
    memory_utilization holds in Python too, where the CLI did not size the pool."""
    import types
    from nanojax.engine import kv_cache
    from nanojax.errors import ConfigError
    card = 100 << 30
    for env in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(env, raising=False)

    def pool(share):
        dev = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": int(card * share),
                                                          "bytes_in_use": 10 << 30})
        monkeypatch.setattr(kv_cache.jax, "local_devices", lambda: [dev])
    pool(0.75)  # jax's default pool
    assert kv_cache.free_device_bytes(0.9) == int(0.75 * card * 0.9) - (10 << 30)
    assert kv_cache.free_device_bytes(0.5) == int(0.5 * card * 0.9) - (10 << 30)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    pool(0.9)  # the CLI's pool
    assert kv_cache.free_device_bytes(0.9) == int(0.9 * card * 0.9) - (10 << 30)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ConfigError, match="not a number"):
        kv_cache.free_device_bytes(0.9)
