"""What a fresh clone met, tried as a new user would (issue 45, item 8): each refusal names
the problem, and those that need no model come before the model's load."""
import json
import os
import re
import subprocess
import sys

import pytest

from nanojax.cli import main


@pytest.fixture
def no_model_load(monkeypatch):
    """main() in this process, with loading a model an error: a refusal that comes after
    the load fails the test. The CLI's process-wide settings (compile cache, XLA flags)
    are kept out of the test process."""
    import checkpoints.loader
    from nanojax import compile_cache

    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    def load_source(*a, **k):
        raise AssertionError("the weights were read before the destination was checked")

    monkeypatch.setattr(checkpoints.loader, "load_model", load_model)
    monkeypatch.setattr(checkpoints.loader, "load_source", load_source)
    monkeypatch.setattr(compile_cache, "configure", lambda args: None)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


@pytest.mark.parametrize("flags,message", [
    (["--seed", "-1"], "seed must be a non-negative integer"),
    (["--top-p", "2"], "top_p must be a finite number in (0.0, 1.0]"),
    (["--top-k", "-3"], "top_k must be -1 (off) or a non-negative integer"),
    (["--model", "random:tiny"], "random:tiny has no tokenizer: give the prompt as token "
                                 "ids, e.g. --prompt-token-ids 1,2,3"),
    (["--prompt-token-ids", "1,2"], "give either a prompt or --prompt-token-ids"),
])
def test_generate_refuses_bad_arguments_before_loading(no_model_load, capsys, flags,
                                                       message):
    assert main(["generate", "hi", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,message", [
    ("--max-tokens", "abc", "argument --max-tokens: expected a positive integer, got 'abc'"),
    ("--max-tokens", "0", "argument --max-tokens: expected a positive integer, got '0'"),
    ("--temperature", "nan", "argument --temperature: expected a number >= 0, got 'nan'"),
    ("--top-k", "x", "argument --top-k: expected an integer, got 'x'"),
    ("--prompt-token-ids", "1,,2", "expected comma-separated token ids such as 1,2,3"),
    ("--prompt-token-ids", "1,-2", "expected non-negative token ids, got '1,-2'"),
])
def test_argument_errors_say_what_was_expected(no_model_load, capsys, flag, value, message):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "invalid" not in err


def test_generate_without_any_prompt_says_how_to_give_one(no_model_load, capsys):
    assert main(["generate", "--model", "random:tiny"]) == 2
    assert "give either a prompt or --prompt-token-ids" in capsys.readouterr().err


def test_convert_refuses_an_existing_destination_before_reading_weights(
        no_model_load, capsys, tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    dst = tmp_path / "ckpt"
    dst.mkdir()
    assert main(["convert", str(src), str(dst)]) == 2
    assert "already exists (use --overwrite)" in capsys.readouterr().err


def test_serve_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert re.search(r"--max-waiting MAX_WAITING .*\(default: 256\)", out)
    assert re.search(r"--drain-timeout DRAIN_TIMEOUT .*\(default: 5.0\)", out)
    assert "--reasoning-parser {qwen3,deepseek_r1}" in out
    assert re.search(r"--generation-config \{auto,vllm\} .*\(default: auto\)", out)


def test_serve_logging_keeps_other_libraries_info_lines_out():
    """At INFO, jax's failed libtpu probe and orbax's (absl's) checkpoint lines were the
    server's first screen; their warnings still show, and nanojax's own INFO lines."""
    code = ("import logging\n"
            "from absl import logging as absl_logging\n"
            "from nanojax.server.cli import configure_logging\n"
            "configure_logging()\n"
            "absl_logging.info('ABSL-INFO')\n"
            "logging.getLogger('jax._src.xla_bridge').info('XLA-BRIDGE-INFO')\n"
            "logging.getLogger('jax._src.xla_bridge').warning('XLA-BRIDGE-WARNING')\n"
            "logging.getLogger('nanojax.server').info('NANOJAX-INFO')\n"
            "logging.getLogger('aiohttp.access').info('ACCESS-INFO')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ABSL-INFO" not in res.stderr and "XLA-BRIDGE-INFO" not in res.stderr
    for shown in ("XLA-BRIDGE-WARNING", "NANOJAX-INFO", "ACCESS-INFO"):
        assert shown in res.stderr


def test_random_model_generates_from_token_ids():
    """random:<shape> models have no tokenizer: the prompt goes in, and the output comes
    out, as token ids."""
    res = subprocess.run([sys.executable, "-m", "nanojax", "generate", "--model",
                          "random:tiny", "--prompt-token-ids", "1,2,3", "--max-tokens", "3"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(r"\d+,\d+,\d+", res.stdout.strip()), res.stdout


def test_chat_template_jinja_of_transformers_5_is_read(tmp_path):
    """transformers 5 saves the chat template beside the tokenizer, in
    chat_template.jinja, not in tokenizer_config.json."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from nanojax.tokenizer import Tokenizer
    backend = HFTokenizer(WordLevel({"<unk>": 0, "hi": 1, "</s>": 2}, unk_token="<unk>"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    hf.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        pytest.skip("this transformers keeps the template in tokenizer_config.json")
    assert (tmp_path / "hf" / "chat_template.jinja").is_file()
    tok = Tokenizer.load(tmp_path / "hf")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    (tmp_path / "ckpt").mkdir()  # a converted checkpoint keeps it
    tok.save(tmp_path / "ckpt")
    assert Tokenizer.load(tmp_path / "ckpt").chat_template == hf.chat_template
