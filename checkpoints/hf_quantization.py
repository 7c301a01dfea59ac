"""Which FP8 checkpoint an HF directory holds, from its config.json `quantization_config`.

The two formats vLLM loads for FP8 weights (both: e4m3 `weight` [out, in] and a
`weight_scale` that multiplies it back, optionally an `input_scale` that divides the
activations; the LM head and embeddings unquantized):
- compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes):
  "quant_method": "compressed-tensors", "format": "float-quantized" (or
  "naive-quantized"), config_groups whose weights are {"num_bits": 8, "type": "float",
  "strategy": "channel" | "tensor" | "block" (with "block_structure": [rows, cols])} and
  whose input_activations are dynamic per token (or per group of a block scheme), static
  per tensor, or absent (weights only: nanojax then quantizes activations per token, as
  W8A8);
- "fp8" (vLLM's own / AutoFP8, and DeepSeek-V3 / Qwen3-FP8 with "weight_block_size":
  [rows, cols] and block scales named `weight_scale_inv`): "activation_scheme": "dynamic"
  | "static" (input_scale; dynamic only with blocks).
Block-wise weights are requantized per output channel at load (layers/fp8.py
requantize_blocks): nanojax's FP8 GEMM takes per-channel scales. MoE checkpoints store
each expert's weight and scales (stacked at load); their routers stay unquantized.
Anything else is refused by name: another method (GPTQ, AWQ, ...), other bit widths,
grouped weight scales, or an ignore list that leaves some decoder projection unquantized
(nanojax quantizes all of them or none).
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

from nanojax.errors import UnsupportedError

_FLOAT_FORMATS = ("float-quantized", "naive-quantized")
# what an ignore-list entry starting with one of these names is read as (vLLM and
# transformers match entries as substrings too): the decoder's projections
_DECODER_PARTS = ("layers", "self_attn", "mlp", "block_sparse_moe", "experts", "shared_expert",
                  "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "w1", "w2", "w3")
_FLOAT_MODULES = ("lm_head", "embed_tokens", "mlp.gate", "block_sparse_moe.gate",
                  "shared_expert_gate")
# one of each projection an FP8 checkpoint must quantize, as the HF models name them
_PROJECTION_NAMES = tuple(
    [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    + [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    + [f"model.layers.0.mlp.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    + [f"model.layers.0.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    + [f"model.layers.0.block_sparse_moe.experts.0.{p}" for p in ("w1", "w2", "w3")])


class FP8Scheme(NamedTuple):
    quantization: str | None     # ModelConfig.quantization: None or "fp8"
    activation_scale: str        # ModelConfig.activation_scale: "dynamic" | "static"
    weight_block: tuple[int, int] | None = None  # block-wise weight scales: (rows, cols)


def _refuse(msg: str):
    raise UnsupportedError(f"unsupported quantized checkpoint: {msg}; nanojax loads FP8 "
                           "(e4m3) checkpoints in the compressed-tensors and 'fp8' formats, "
                           "per-channel, per-tensor or block-wise scales")


def _block(value, what: str) -> tuple[int, int]:
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16
                  for v in value))
    if not ok:
        _refuse(f"{what} {value!r} (two positive integers expected)")
    return int(value[0]), int(value[1])


def _object(value, what: str) -> dict:
    """A config entry that must be a JSON object (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        _refuse(f"{what} is {type(value).__name__}, not an object")
    return value


def _stays_float(entry) -> bool:
    """Does an ignore-list entry name only modules nanojax keeps in the model dtype (the LM
    head, the embeddings, an MoE router, the shared expert's gate) or does not load (a
    vision tower: llm-compressor lists each of its Linears)? A module name must end in one
    of them or lie outside `model.layers`; a "re:" pattern (matched as vLLM does, from
    the name's start) must match none of the decoder's projections."""
    if not isinstance(entry, str):
        return False
    if not entry.startswith("re:"):  # a float module, or one outside the decoder's layers
        inside = (entry == "model.layers" or entry.startswith("model.layers.")
                  or entry.split(".")[0] in _DECODER_PARTS)  # a bare "o_proj": every one
        return entry.endswith(_FLOAT_MODULES) or not inside
    try:
        pattern = re.compile(entry[3:])
    except re.error as e:
        _refuse(f"ignore pattern {entry!r} is not a regular expression ({e})")
    return not any(pattern.match(name) for name in _PROJECTION_NAMES)


def _check_ignored(ignored, what: str) -> None:
    if ignored is not None and not isinstance(ignored, list):
        _refuse(f"{what} is not a list")
    inside = [i for i in ignored or [] if not _stays_float(i)]
    if inside:
        _refuse(f"{what} {inside[:4]} leaves decoder projections unquantized")


def fp8_scheme(hf: dict[str, Any]) -> FP8Scheme:
    """The checkpoint's FP8 scheme: (None, "dynamic") for an unquantized checkpoint."""
    q = hf.get("quantization_config") or hf.get("compression_config")
    if not q:
        return FP8Scheme(None, "dynamic")
    if not isinstance(q, dict):
        _refuse("quantization_config is not an object")
    method = q.get("quant_method")
    if method == "fp8":
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            _refuse(f"activation_scheme {scheme!r}")
        for key in ("modules_to_not_convert", "ignored_layers"):
            _check_ignored(q.get(key), key)
        block = q.get("weight_block_size")
        if block is None:
            return FP8Scheme("fp8", scheme)
        if scheme != "dynamic":
            _refuse("block-wise FP8 with static activation scales")
        return FP8Scheme("fp8", "dynamic", _block(block, "weight_block_size"))
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    _refuse(f"quant_method {method!r}")


def _compressed_tensors(q: dict) -> FP8Scheme:
    fmt = q.get("format")
    if fmt not in _FLOAT_FORMATS:
        _refuse(f"compressed-tensors format {fmt!r}")
    groups = q.get("config_groups") or {}
    if not groups or not isinstance(groups, dict):
        _refuse("compressed-tensors without config_groups")
    scales, blocks = set(), set()
    for name, g in groups.items():
        g = _object(g, f"group {name}")
        w = _object(g.get("weights"), f"group {name}: weights")
        if w.get("num_bits") != 8 or w.get("type") != "float":
            _refuse(f"group {name}: weights of {w.get('num_bits')} bits, type {w.get('type')!r}")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            _refuse(f"group {name}: weight strategy {strategy!r}")
        if w.get("dynamic"):
            _refuse(f"group {name}: dynamic weight scales")
        if w.get("symmetric") is False:
            _refuse(f"group {name}: asymmetric weights (zero points)")
        blocks.add(_block(w.get("block_structure"), f"group {name}: block_structure")
                   if strategy == "block" else None)
        a = g.get("input_activations")
        if a is None:
            scales.add("dynamic")  # weight-only FP8: activations quantized per token here
            continue
        a = _object(a, f"group {name}: input_activations")
        if a.get("symmetric") is False:
            _refuse(f"group {name}: asymmetric activations (zero points)")
        if a.get("num_bits") != 8 or a.get("type") != "float":
            _refuse(f"group {name}: activations of {a.get('num_bits')} bits")
        # a block scheme's per-group activation scales: per token here (a coarser scale)
        per_row = ("token", "tensor", "group") if strategy == "block" else ("token", "tensor")
        if a.get("dynamic") and a.get("strategy") in per_row:
            scales.add("dynamic")
        elif not a.get("dynamic") and a.get("strategy") == "tensor" and strategy != "block":
            scales.add("static")
        else:
            _refuse(f"group {name}: activation strategy {a.get('strategy')!r} "
                    f"(dynamic {a.get('dynamic')}) with {strategy} weights")
    if len(scales) > 1:
        _refuse("groups with both static and dynamic activation scales")
    if len(blocks) > 1:
        _refuse(f"groups with different weight scale layouts {sorted(map(str, blocks))}")
    _check_ignored(q.get("ignore"), "ignore list")
    return FP8Scheme("fp8", scales.pop(), blocks.pop())
