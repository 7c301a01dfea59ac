"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer.json."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from tqdm.auto import tqdm

from checkpoints.bundle import assemble_params, hf_tensor_names
from checkpoints.hf_quantization import fp8_scheme
from nanojax.config import ModelConfig
from nanojax.errors import CheckpointError
from nanojax.models.bundle import ModelBundle
from nanojax.tokenizer import Tokenizer


def load_hf_dir(path: Path, dtype: str = "bfloat16", progress: bool = True) -> ModelBundle:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"missing {cfg_file} (an HF model directory needs config.json)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt {cfg_file}: {e}") from None
    quantization, activation_scale = fp8_scheme(hf)
    cfg = ModelConfig.from_hf(hf, dtype=dtype).replace(quantization=quantization,
                                                       activation_scale=activation_scale)
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
    fp8_tensors = {n: f for f in files for n, info in safetensors_header(f).items()
                   if info.get("dtype") == "F8_E4M3"} if cfg.quantization else {}
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in where:
        cfg = cfg.replace(tie_word_embeddings=True)  # some exports drop the tied head

    def get(name):
        if name not in where:
            raise CheckpointError(f"{path} lacks tensor {name}")
        try:
            if name in fp8_tensors:  # safetensors' numpy reader has no float8 type
                return read_fp8(fp8_tensors[name], name)
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


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_fp8(path: Path, name: str) -> np.ndarray:
    """One F8_E4M3 tensor of a safetensors file, as ml_dtypes' float8_e4m3fn (the layout
    is the documented one: 8-byte header length, JSON header, raw little-endian data)."""
    import ml_dtypes
    info = safetensors_header(path)[name]
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin, end = info["data_offsets"]
        f.seek(8 + n + begin)
        raw = f.read(end - begin)
    return np.frombuffer(raw, np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])
