"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer.json."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

from tqdm.auto import tqdm

from checkpoints.generation_config import read_generation_config
from checkpoints.bundle import assemble_params, check_fp8_tensor, hf_tensor_names
from checkpoints.hf_quantization import fp8_scheme
from nanojax.config import ModelConfig
from nanojax.errors import CheckpointError, UnsupportedError
from nanojax.layers.fp8 import WEIGHT_BLOCK
from nanojax.models.bundle import ModelBundle
from nanojax.tokenizer import Tokenizer


def load_hf_dir(path: Path, dtype: str = "bfloat16", progress: bool = True,
                keep_fp8_blocks: bool = False) -> ModelBundle:
    """keep_fp8_blocks: a block-wise FP8 checkpoint (128 x 128 blocks) loads as
    quantization "fp8-block" with its weights and scales as stored; without it (or with
    other blocks) its weights are requantized per output channel ("fp8")."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"missing {cfg_file} (an HF model directory needs config.json)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt {cfg_file}: {e}") from None
    scheme = fp8_scheme(hf)
    keep = keep_fp8_blocks and scheme.weight_block is not None
    if keep and scheme.weight_block != (WEIGHT_BLOCK, WEIGHT_BLOCK):
        raise CheckpointError(f"fp8-block keeps {WEIGHT_BLOCK} x {WEIGHT_BLOCK} weight blocks; "
                              f"{path} has {scheme.weight_block[0]} x {scheme.weight_block[1]} "
                              "(quantization 'fp8' requantizes them per channel)")
    cfg = ModelConfig.from_hf(hf, dtype=dtype).replace(
        quantization="fp8-block" if keep else scheme.quantization,
        activation_scale=scheme.activation_scale)
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
    # name -> (file, header entry), each file's header read once
    fp8_tensors = {n: (f, info) for f in files for n, info in safetensors_header(f).items()
                   if str(info.get("dtype", "")).startswith("F8_")}
    other = sorted(n for n, (_, info) in fp8_tensors.items() if info["dtype"] != "F8_E4M3")
    if other:
        raise UnsupportedError(f"tensor {other[0]} is {fp8_tensors[other[0]][1]['dtype']}; "
                               "nanojax loads FP8 checkpoints in e4m3 (F8_E4M3) only")
    if fp8_tensors and not cfg.quantization:
        raise CheckpointError(f"tensor {sorted(fp8_tensors)[0]} is stored in FP8, but "
                              f"{cfg_file} has no quantization_config saying how to read it")
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in where:
        cfg = cfg.replace(tie_word_embeddings=True)  # some exports drop the tied head

    def read(name):
        if name not in where:
            raise CheckpointError(f"{path} lacks tensor {name}")
        try:
            if name in fp8_tensors:  # safetensors' numpy reader has no float8 type
                return read_fp8(*fp8_tensors[name])
            return where[name].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from None

    get = read
    if scheme.weight_block is not None:
        get = BlockFP8Reader(read, scheme.weight_block, set(where), set(fp8_tensors),
                             requantize=not keep)
        if progress and not keep:
            print(f"nanojax: block-wise FP8 weights ({scheme.weight_block[0]}x"
                  f"{scheme.weight_block[1]}) are requantized per output channel at load",
                  file=sys.stderr)

    with tqdm(total=len(hf_tensor_names(cfg)), desc="loading safetensors", unit="tensor",
              disable=not progress) as bar:
        params = assemble_params(cfg, get, bar)
    tok = Tokenizer.load(path) if (path / "tokenizer.json").is_file() else None
    if tok is not None and not tok.eos_token_ids and cfg.eos_token_ids:
        tok.eos_token_ids = cfg.eos_token_ids
    defaults, stops = read_generation_config(path)
    if stops:  # generation_config's stop tokens join the tokenizer's (Qwen3: both ends)
        cfg = cfg.replace(eos_token_ids=_union(cfg.eos_token_ids, stops))
        if tok is not None:
            tok.eos_token_ids = _union(tok.eos_token_ids, stops)
            tok.config["eos_token_ids"] = list(tok.eos_token_ids)  # kept by tok.save()
    return ModelBundle(cfg, params, tok, sampling_defaults=defaults)


def _union(first: tuple[int, ...], more: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys((*first, *more)))


class BlockFP8Reader:
    """`get` for a block-wise FP8 checkpoint: each projection's `weight` comes back
    requantized per output channel (layers/fp8.py requantize_blocks, jitted per tensor)
    and its `weight_scale` as the per-channel scale; every other tensor as stored. With
    requantize=False the weight as stored and `weight_scale` the block scales (whichever
    name the format gives them), each checked against the weight's shape."""

    def __init__(self, read, block: tuple[int, int], names: set[str], fp8_names: set[str],
                 requantize: bool = True):
        import jax
        from nanojax.layers.fp8 import requantize_blocks
        self.read, self.block, self.names, self.fp8_names = read, block, names, fp8_names
        self.requant = jax.jit(requantize_blocks, static_argnums=2) if requantize else None
        self.scales: dict[str, np.ndarray] = {}

    def _block_scale_name(self, prefix: str) -> str | None:
        for leaf in ("weight_scale_inv", "weight_scale"):  # "fp8" / compressed-tensors
            if prefix + leaf in self.names:
                return prefix + leaf
        return None

    def __call__(self, name: str) -> np.ndarray:
        prefix, leaf = name.rsplit(".", 1)[0] + ".", name.rsplit(".", 1)[1]
        if leaf == "weight_scale" and name in self.scales:
            return self.scales.pop(name)
        if not (leaf == "weight_scale" or (leaf == "weight" and name in self.fp8_names)):
            return self.read(name)  # norms, embeddings, the LM head; a missing weight
        scale_name = self._block_scale_name(prefix)
        if scale_name is None:
            raise CheckpointError(f"block-wise FP8 checkpoint lacks {prefix}weight_scale_inv "
                                  f"(or weight_scale) for {prefix}weight")
        if prefix + "weight" not in self.fp8_names:
            raise CheckpointError(f"tensor {prefix}weight is not F8_E4M3 in a block-wise "
                                  "FP8 checkpoint")
        weight = self.read(prefix + "weight")
        scale = np.asarray(self.read(scale_name))
        if self.requant is not None:  # (kept as stored, assemble_params checks them)
            weight = check_fp8_tensor(weight, "weight", prefix + "weight")
            scale = check_fp8_tensor(scale, "weight_scale", scale_name)
        rows, cols = self.block
        if weight.ndim != 2:
            raise CheckpointError(f"tensor {prefix}weight has shape {weight.shape}, not 2-D")
        want = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
        if scale.shape != want:
            raise CheckpointError(f"tensor {scale_name} has shape {scale.shape}; {rows}x{cols} "
                                  f"blocks of weight {tuple(weight.shape)} need {want}")
        if self.requant is None:
            w8, kept = weight, scale
        else:
            w8, kept = self.requant(weight, scale, self.block)
        self.scales[prefix + "weight_scale"] = np.asarray(kept)
        return np.asarray(w8) if leaf == "weight" else self.scales.pop(name)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_fp8(path: Path, info: dict) -> np.ndarray:
    """One F8_E4M3 tensor of a safetensors file (info: its header entry), as ml_dtypes'
    float8_e4m3fn (the layout is the documented one: 8-byte header length, JSON header,
    raw little-endian data)."""
    import ml_dtypes
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        begin, end = info["data_offsets"]
        f.seek(8 + n + begin)
        raw = f.read(end - begin)
    return np.frombuffer(raw, np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])
