"""Writes small LLaMA-family GGUF files (llama, qwen2, qwen3) the way llama.cpp's converter
does."""
from __future__ import annotations

import numpy as np

from checkpoints.bundle import hf_tensor_names


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate-half -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight"}


_MOE = {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
        "w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight", "w2": "ffn_down_exps.weight"}


def gguf_name(hf) -> str:
    """The GGUF name of an HF tensor, or of a tuple of per-expert tensors (Mixtral)."""
    if isinstance(hf, tuple):  # model.layers.N.block_sparse_moe.experts.0.w1.weight, ...
        _, _, idx, *_, proj, _ = hf[0].split(".")
        return f"blk.{idx}.{_MOE[proj]}"
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, idx, rest = hf.split(".", 3)
    return f"blk.{idx}.{_MOE.get(rest) or _BLOCK[rest]}"


def byte_level_vocab(size: int) -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = list(bytes_to_unicode().values()) + ["ab"]
    tokens += [f"<extra_{i}>" for i in range(size - len(tokens) - 1)] + ["<|end|>"]
    types = [1] * (size - 1) + [3]
    return tokens, types


def write_llama_gguf(path, cfg, params: dict, quant: str = "F32",
                     override: dict | None = None) -> None:
    """params: our {"params": ...} tree (numpy, f32). `override` maps a GGUF tensor name to
    (raw uint8 data, quant type name) for hand-made blocks."""
    # as llama.cpp writes them: Mixtral as a "llama" file with experts; q/k permuted for
    # LLaMA only; Qwen3's head_dim as key_length, without a rope dimension count
    import gguf  # here, not at import: the GPU box has no gguf and runs these modules' -m gpu
    arch = "llama" if cfg.architecture in ("llama", "mixtral") else cfg.architecture
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:
        w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.is_moe:  # llama.cpp's Mixtral: a llama file with experts
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    tokens, types = byte_level_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(cfg.vocab_size - 1)
    override = override or {}
    qtype = gguf.GGMLQuantizationType[quant]
    for path_, (hf, transpose) in hf_tensor_names(cfg).items():
        arr = params["params"]
        for k in path_:
            arr = arr[k]
        arr = np.asarray(arr, np.float32)
        if transpose:  # each expert's [in, out] back to [out, in]
            arr = arr.swapaxes(-1, -2)
        if arch != "llama":
            pass
        elif isinstance(hf, str) and hf.endswith("q_proj.weight"):
            arr = _permute(arr, cfg.num_heads)
        elif isinstance(hf, str) and hf.endswith("k_proj.weight"):
            arr = _permute(arr, cfg.num_kv_heads)
        name = gguf_name(hf)
        if name in override:
            raw, q = override[name]
            w.add_tensor(name, raw, raw_shape=raw.shape,
                         raw_dtype=gguf.GGMLQuantizationType[q])
        elif arr.ndim == 1 or quant == "F32":
            w.add_tensor(name, np.ascontiguousarray(arr))
        else:
            data = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
