"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer.json."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from checkpoints.bundle import ModelBundle, assemble_params, hf_tensor_names
from nanojax.config import ModelConfig
from nanojax.errors import CheckpointError
from nanojax.tokenizer import Tokenizer


def load_hf_dir(path: Path, dtype: str = "bfloat16", progress: bool = True) -> ModelBundle:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"missing {cfg_file} (an HF model directory needs config.json)")
    try:
        cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()), dtype=dtype)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt {cfg_file}: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    where = {}
    handles = []
    for f in files:
        try:
            h = safe_open(str(f), framework="numpy")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"truncated or corrupt safetensors file {f}: {e}") from None
        handles.append(h)
        for key in h.keys():
            where[key] = h
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in where:
        cfg = cfg.replace(tie_word_embeddings=True)  # some exports drop the tied head

    def get(name):
        if name not in where:
            raise CheckpointError(f"{path} lacks tensor {name}")
        try:
            return where[name].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from None

    with tqdm(total=len(hf_tensor_names(cfg)), desc="loading safetensors", unit="tensor",
              disable=not progress) as bar:
        params = assemble_params(cfg, get, bar)
    tok = Tokenizer.load(path) if (path / "tokenizer.json").is_file() else None
    if tok is not None and not tok.eos_token_ids and cfg.eos_token_ids:
        tok.eos_token_ids = cfg.eos_token_ids
    return ModelBundle(cfg, params, tok)
