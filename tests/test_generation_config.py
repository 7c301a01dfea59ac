"""A model's generation_config.json: its stop tokens join the tokenizer's, its sampling
defaults reach requests that leave those fields unset (server and LLM, vLLM's
--generation-config auto), a nanojax checkpoint keeps them; bad files are named."""
import json

import pytest

from checkpoints.generation_config import read_generation_config
from nanojax.errors import CheckpointError
from nanojax.server.protocol import parse_chat, with_sampling_defaults

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
         "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
         "transformers_version": "4.51.0"}


def test_qwen3s_file_gives_its_sampling_and_both_stop_tokens(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    defaults, eos = read_generation_config(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert eos == (151645, 151643)
    assert read_generation_config(tmp_path / "nowhere") == ({}, ())


def test_transformers_defaults_drop_out_and_max_new_tokens_is_max_tokens(tmp_path, capsys):
    """As vLLM reads the file (GenerationConfig.to_diff_dict): a value equal to
    transformers' default changes nothing; max_new_tokens becomes the default max_tokens."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 1.0, "top_k": 50, "top_p": 0.8, "max_new_tokens": 100, "min_p": 0.05}))
    assert read_generation_config(tmp_path) == (
        {"top_p": 0.8, "max_tokens": 100, "min_p": 0.05}, ())


def test_values_a_request_could_not_give_are_left_out(tmp_path, capsys):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 7.0, "top_p": 0.0, "top_k": 0, "repetition_penalty": "high",
         "eos_token_id": 2}))
    assert read_generation_config(tmp_path) == ({}, (2,))
    err = capsys.readouterr().err
    assert "temperature 7.0" in err and "top_p 0.0" in err and "repetition_penalty" in err
    assert "top_k" not in err  # 0: transformers' "no top-k", nothing to say


@pytest.mark.parametrize("text, needle", [("{not json", "corrupt"), ("[1, 2]", "not a JSON object"),
                                          ('{"eos_token_id": "</s>"}', "eos_token_id"),
                                          ('{"eos_token_id": [1, -2]}', "eos_token_id"),
                                          ("[" * 100000, "corrupt")])
def test_a_bad_file_is_named(tmp_path, text, needle):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=needle):
        read_generation_config(tmp_path)


def test_unset_and_null_fields_take_the_defaults_and_set_ones_win():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    msgs = [{"role": "user", "content": "hi"}]
    p = parse_chat(with_sampling_defaults({"messages": msgs, "top_p": None}, defaults), 1000)
    assert (p[1].params.temperature, p[1].params.top_p, p[1].params.top_k) == (0.6, 0.95, 20)
    p = parse_chat(with_sampling_defaults({"messages": msgs, "temperature": 0}, defaults), 1000)
    assert (p[1].params.temperature, p[1].params.top_k) == (0.0, 20)
    assert with_sampling_defaults({"messages": msgs}, {}) == {"messages": msgs}


def test_hf_directory_to_engine_and_checkpoint(tmp_path, smollm2):
    """An HF directory's file: the bundle's defaults and stop tokens (the tokenizer's
    too); LLM's default params ("vllm": none); a nanojax checkpoint converted from it keeps
    them all."""
    from test_checkpoints import _make_hf_dir

    from checkpoints.hf_import import load_hf_dir
    from checkpoints.orbax_store import load_orbax, save_orbax
    from nanojax.engine.llm import LLM
    _make_hf_dir(tmp_path, "qwen2-bias-tied")
    src = tmp_path / "qwen2-bias-tied"
    (src / "generation_config.json").write_text(json.dumps({**QWEN3, "eos_token_id": [7, 9]}))
    smollm2.tokenizer.save(src)  # a real tokenizer beside it
    bundle = load_hf_dir(src, dtype="float32", progress=False)
    assert bundle.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert bundle.config.eos_token_ids[-2:] == (7, 9)
    assert bundle.tokenizer.eos_token_ids == (*smollm2.tokenizer.eos_token_ids, 7, 9)
    llm = LLM(bundle, num_pages=16, max_model_len=64, b_dense=16)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.95, 20)
    plain = LLM(bundle, num_pages=16, max_model_len=64, b_dense=16, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0
    back = load_orbax(save_orbax(bundle, tmp_path / "ck"))
    assert back.sampling_defaults == bundle.sampling_defaults
    assert back.tokenizer.eos_token_ids == bundle.tokenizer.eos_token_ids
    with pytest.raises(ValueError, match="generation_config"):
        LLM(bundle, generation_config="model")


def test_generate_cli_takes_the_models_sampling_where_no_flag_sets_it():
    """`nanojax generate`: flags, then generation_config.json, then greedy/64 tokens."""
    from nanojax.cli import _check_generate_args, build_parser, generate_sampling_params
    qwen3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    bare = build_parser().parse_args(["generate", "hi", "--model", "smollm2-135m"])
    assert bare.generation_config == "auto"
    given = _check_generate_args(bare)
    assert given == {}
    sp = generate_sampling_params(given, qwen3)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.6, 0.95, 20, 300)
    assert generate_sampling_params(given, {}).temperature == 0.0  # greedy without either
    assert generate_sampling_params(given, {}).max_tokens == 64
    flags = build_parser().parse_args(["generate", "hi", "--model", "smollm2-135m",
                                       "--temperature", "0", "--max-tokens", "8"])
    sp = generate_sampling_params(_check_generate_args(flags), qwen3)
    assert (sp.temperature, sp.max_tokens, sp.top_k) == (0.0, 8, 20)
