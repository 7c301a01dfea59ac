"""The `nanojax` command line, run as a user would (subprocess)."""
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
