"""GGUF import: config from metadata, dequantized weights, the BPE tokenizer.

llama.cpp stores LLaMA's q and k projection rows permuted for its interleaved RoPE; we undo
that so the weights match the HF layout (rotate-half RoPE). Qwen2 files are not permuted.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tqdm.auto import tqdm

from checkpoints.bundle import assemble_params, hf_tensor_names
from nanojax.config import ModelConfig
from nanojax.errors import CheckpointError, ConfigError, UnsupportedError
from nanojax.models.bundle import ModelBundle
from nanojax.paths import cache_dir
from nanojax.tokenizer import Tokenizer

SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
PERMUTED_ARCHS = ("llama", "mixtral")
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Pre-tokenizer split patterns by llama.cpp's `tokenizer.ggml.pre` name.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
               "deepseek-r1-qwen": _QWEN2_SPLIT}


def _open(path: Path):
    import gguf
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{path} is not a GGUF file (bad magic)")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # truncated files fail inside numpy memmap / struct parsing
        raise CheckpointError(f"truncated or corrupt GGUF file {path}: {e}") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, dtype: str = "bfloat16") -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(f"GGUF architecture {arch!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def need(key):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ConfigError("GGUF metadata gives no vocabulary size")
    tensor_names = {t.name for t in reader.tensors}
    scaling = None
    if "rope_freqs.weight" in tensor_names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"freq_factors": [float(x) for x in np.asarray(t.data, np.float64)]}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    ffn = int(need("feed_forward_length"))
    moe = {}
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if experts:  # llama.cpp writes Mixtral as "llama" with experts
        if arch != "llama":
            raise UnsupportedError(f"GGUF {arch!r} with {experts} experts is not supported "
                                   "(mixture of experts: Mixtral-style 'llama' files only)")
        moe = dict(architecture="mixtral", num_experts=experts,
                   num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=ffn, norm_topk_prob=True)
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=int(need("block_count")), num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        # key_length: Qwen3's head_dim, which need not be hidden // heads
        head_dim=int(_field(reader, f"{arch}.attention.key_length")
                     or _field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        dtype=dtype, **{"architecture": arch, **moe},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else ())


# Mixtral in GGUF: the router, and each projection of all experts in one [E, out, in]
# tensor (older files: one tensor per expert, ffn_gate.E.weight)
_MOE_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def _hf_names(gguf_name: str, num_experts: int = 0) -> list[tuple[str, int | None]]:
    """The HF tensors a GGUF tensor holds: [(name, expert index in it or None)]."""
    if gguf_name in _GGUF_TO_HF:
        return [(_GGUF_TO_HF[gguf_name], None)]
    if not gguf_name.startswith("blk."):
        return []
    _, idx, rest = gguf_name.split(".", 2)
    layer = f"model.layers.{idx}."
    if num_experts:
        moe = layer + "block_sparse_moe."
        if rest == "ffn_gate_inp.weight":
            return [(moe + "gate.weight", None)]
        parts = rest.split(".")
        kind = parts[0].removeprefix("ffn_").removesuffix("_exps")
        if kind in _MOE_PROJ and parts[0].endswith("_exps"):
            return [(f"{moe}experts.{e}.{_MOE_PROJ[kind]}.weight", e)
                    for e in range(num_experts)]
        if kind in _MOE_PROJ and len(parts) == 3 and parts[1].isdigit():
            return [(f"{moe}experts.{parts[1]}.{_MOE_PROJ[kind]}.weight", None)]
    if rest in _BLOCK_TO_HF:
        return [(layer + _BLOCK_TO_HF[rest], None)]
    return []


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (interleaved -> rotate-half pairs)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t) -> np.ndarray:
    import gguf
    qname = t.tensor_type.name
    if qname not in SUPPORTED_QUANTS:
        raise UnsupportedError(f"tensor {t.name} uses quantization {qname}, which nanojax does "
                               f"not import (supported: {', '.join(SUPPORTED_QUANTS)})")
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(f"cannot dequantize tensor {t.name} ({qname}): {e}") from None
    return np.asarray(arr, dtype=np.float32)


def load_gguf(path: Path, dtype: str = "bfloat16", with_tokenizer: bool = True,
              progress: bool = True) -> ModelBundle:
    reader = _open(path)
    cfg = config_from_gguf(reader, dtype)
    by_hf = {}
    for t in reader.tensors:
        for name, expert in _hf_names(t.name, cfg.num_experts):
            by_hf[name] = (t, expert)
    permute = cfg.architecture in PERMUTED_ARCHS
    stacked = {}  # the last dequantized all-experts tensor: its experts are read in turn

    def get(name: str) -> np.ndarray:
        if name not in by_hf:
            raise CheckpointError(f"GGUF file {path} lacks the tensor for {name}")
        t, expert = by_hf[name]
        if expert is None:
            arr = dequantize_tensor(t)
        else:
            if stacked.get("name") != t.name:
                stacked.update(name=t.name, arr=dequantize_tensor(t))
            arr = stacked["arr"]
            if arr.ndim != 3 or arr.shape[0] != cfg.num_experts:
                raise CheckpointError(f"GGUF tensor {t.name} has shape {arr.shape}, not "
                                      f"[{cfg.num_experts}, out, in]")
            arr = arr[expert]
        if permute and ".q_proj.weight" in name:
            arr = _unpermute(arr, cfg.num_heads)
        elif permute and ".k_proj.weight" in name:
            arr = _unpermute(arr, cfg.num_kv_heads)
        return arr

    n = len(hf_tensor_names(cfg))
    with tqdm(total=n, desc="dequantizing GGUF", unit="tensor", disable=not progress) as bar:
        params = assemble_params(cfg, get, bar)
    tok = tokenizer_from_gguf(reader) if with_tokenizer else None
    return ModelBundle(cfg, params, tok, gguf=Path(path), read_gguf_blocks=cached_quantized)


# Block layouts kept as stored (nanojax/layers/quant.py): bytes per block of 32 weights
_KEPT_QUANTS = {"Q4_1": 20, "Q8_0": 34}


def _unpack_blocks(t, rows: int) -> dict | None:
    """A Q4_1 / Q8_0 tensor's blocks as {"q" int8 [rows, in/32, 32], "d", ("m") f32
    [rows, in/32]}: the same f32 values gguf's dequantize computes d * q + m from; None for
    other types."""
    qname = t.tensor_type.name
    if qname not in _KEPT_QUANTS:
        return None
    data = np.asarray(t.data, dtype=np.uint8)
    if data.shape[0] != rows or data.shape[-1] % _KEPT_QUANTS[qname]:
        raise CheckpointError(f"GGUF tensor {t.name} ({qname}) has byte shape {data.shape}, "
                              f"not {rows} rows of whole blocks")
    blocks = data.reshape(rows, -1, _KEPT_QUANTS[qname])
    half = lambda a: np.ascontiguousarray(a).view(np.float16)[..., 0].astype(np.float32)
    if qname == "Q8_0":
        return {"q": np.ascontiguousarray(blocks[..., 2:]).view(np.int8), "d": half(blocks[..., :2])}
    qs = blocks[..., 4:]  # element j in the low nibble of byte j, element j + 16 in the high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8)
    return {"q": q, "d": half(blocks[..., :2]), "m": half(blocks[..., 2:4])}


def load_quantized(path: Path, cfg: ModelConfig) -> dict:
    """The projections (and a tied embedding, the LM head) of a GGUF file whose blocks are
    Q4_1 or Q8_0, kept quantized: a tree {"layers_i": {"q_proj": blocks, ...},
    "tied_embed": blocks} beside the f32 parameters' (`quant` variables of the model);
    tensors of other types are left out (they run from f32). Dense models only."""
    reader = _open(path)
    by_hf = {name: t for t in reader.tensors
             for name, expert in _hf_names(t.name, cfg.num_experts) if expert is None}
    permute = cfg.architecture in PERMUTED_ARCHS
    tree: dict = {}
    for tree_path, (hf, transposed) in hf_tensor_names(cfg).items():
        if not isinstance(hf, str) or hf not in by_hf:
            continue
        if tree_path == ("embed", "embedding") and cfg.tie_word_embeddings:
            key, rows = ("tied_embed",), cfg.vocab_size
        elif transposed and tree_path[-1] == "kernel" and "moe" not in tree_path:
            key, rows = tree_path[:-1], int(by_hf[hf].shape[-1])
        else:
            continue
        blocks = _unpack_blocks(by_hf[hf], rows)
        if blocks is None:
            continue
        if permute and ".q_proj.weight" in hf:
            blocks = {k: _unpermute(a, cfg.num_heads) for k, a in blocks.items()}
        elif permute and ".k_proj.weight" in hf:
            blocks = {k: _unpermute(a, cfg.num_kv_heads) for k, a in blocks.items()}
        node = tree
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = blocks
    return tree


def cached_quantized(gguf: Path, cfg: ModelConfig, root: Path | None = None) -> dict:
    """load_quantized's tree, kept as one .npz under <cache dir>/quant/ keyed by the file
    (path, size, mtime) and the model config: gguf's reader parses the whole metadata
    (the vocabulary) to find the blocks, ~5 s a start for the embedded default, while
    the .npz loads in a fraction of a second. A cache that cannot be read or written is
    skipped (the blocks come from the GGUF)."""
    import dataclasses
    import hashlib
    import os

    st = gguf.stat()
    key = hashlib.sha256(repr((str(gguf.resolve()), st.st_size, st.st_mtime_ns,
                               dataclasses.asdict(cfg), 1)).encode()).hexdigest()[:32]
    path = (root or cache_dir()) / "quant" / f"{key}.npz"
    try:
        with np.load(path) as z:
            flat = {k: z[k] for k in z.files}
        tree: dict = {}
        for name, a in flat.items():
            *parents, leaf = name.split("/")
            node = tree
            for k in parents:
                node = node.setdefault(k, {})
            node[leaf] = a
        return tree
    except (OSError, ValueError, KeyError):
        pass
    tree = load_quantized(gguf, cfg)

    def flatten(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from flatten(v, f"{prefix}{k}/")
            else:
                yield f"{prefix}{k}", np.asarray(v)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **dict(flatten(tree)))
        os.replace(tmp, path)  # whole or not at all, also against a parallel start
    except OSError:
        pass
    return tree


def tokenizer_from_gguf(reader) -> Tokenizer:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedError(f"GGUF tokenizer model {kind!r} is not supported "
                               "(only byte-level BPE, 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise CheckpointError("GGUF tokenizer metadata lacks tokens or merges")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False)
    backend = HFTokenizer(bpe)
    pre = _field(reader, "tokenizer.ggml.pre")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_SPLITS)
    if pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special; USER_DEFINED (4) are matched whole but not special.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == 4])

    def token(key):
        i = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = [int(x) for x in (eos, eot) if x is not None]
    config = {
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "eos_token_ids": sorted(set(eos_ids)),
    }
    return Tokenizer(backend, config)
