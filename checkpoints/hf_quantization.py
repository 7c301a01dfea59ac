"""Which FP8 checkpoint an HF directory holds, from its config.json `quantization_config`.

The two formats vLLM loads for FP8 weights (both: e4m3 `weight` [out, in] and a
`weight_scale` that multiplies it back, optionally an `input_scale` that divides the
activations; the LM head and embeddings unquantized):
- compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC schemes): "quant_method":
  "compressed-tensors", "format": "float-quantized" (or "naive-quantized"), config_groups
  whose weights are {"num_bits": 8, "type": "float", "strategy": "channel" | "tensor"} and
  whose input_activations are dynamic per token, static per tensor, or absent (weights
  only: nanojax then quantizes activations per token, as W8A8);
- "fp8" (vLLM's own / AutoFP8): per-tensor weight_scale, "activation_scheme": "dynamic" |
  "static" (input_scale).
Anything else is refused by name: another method (GPTQ, AWQ, ...), other bit widths,
block-wise or grouped scales, or an ignore list that leaves some decoder projection
unquantized (nanojax quantizes all of them or none).
"""
from __future__ import annotations

from typing import Any

from nanojax.errors import UnsupportedError

_FLOAT_FORMATS = ("float-quantized", "naive-quantized")
_OUTSIDE_DECODER = ("lm_head", "re:.*lm_head", "re:.*lm_head.*", "model.embed_tokens")


def _refuse(msg: str):
    raise UnsupportedError(f"unsupported quantized checkpoint: {msg}; nanojax loads FP8 "
                           "(e4m3) checkpoints in the compressed-tensors and 'fp8' formats, "
                           "per-channel or per-tensor scales")


def fp8_scheme(hf: dict[str, Any]) -> tuple[str | None, str]:
    """(quantization, activation_scale) for ModelConfig: (None, "dynamic") for an
    unquantized checkpoint, ("fp8", "dynamic" | "static") for a supported FP8 one."""
    q = hf.get("quantization_config") or hf.get("compression_config")
    if not q:
        return None, "dynamic"
    if not isinstance(q, dict):
        _refuse("quantization_config is not an object")
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size"):
            _refuse(f"block-wise FP8 (weight_block_size {q['weight_block_size']})")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            _refuse(f"activation_scheme {scheme!r}")
        return "fp8", scheme
    if method == "compressed-tensors":
        return "fp8", _compressed_tensors(q)
    _refuse(f"quant_method {method!r}")


def _compressed_tensors(q: dict) -> str:
    fmt = q.get("format")
    if fmt not in _FLOAT_FORMATS:
        _refuse(f"compressed-tensors format {fmt!r}")
    groups = q.get("config_groups") or {}
    if not groups:
        _refuse("compressed-tensors without config_groups")
    scales = set()
    for name, g in groups.items():
        w = g.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            _refuse(f"group {name}: weights of {w.get('num_bits')} bits, type {w.get('type')!r}")
        if w.get("strategy") not in ("channel", "tensor"):
            _refuse(f"group {name}: weight strategy {w.get('strategy')!r}")
        if w.get("dynamic"):
            _refuse(f"group {name}: dynamic weight scales")
        a = g.get("input_activations")
        if a is None:
            scales.add("dynamic")  # weight-only FP8: activations quantized per token here
            continue
        if a.get("num_bits") != 8 or a.get("type") != "float":
            _refuse(f"group {name}: activations of {a.get('num_bits')} bits")
        if a.get("dynamic") and a.get("strategy") in ("token", "tensor"):
            scales.add("dynamic")
        elif not a.get("dynamic") and a.get("strategy") == "tensor":
            scales.add("static")
        else:
            _refuse(f"group {name}: activation strategy {a.get('strategy')!r} "
                    f"(dynamic {a.get('dynamic')})")
    if len(scales) > 1:
        _refuse("groups with both static and dynamic activation scales")
    ignored = [i for i in q.get("ignore") or [] if i not in _OUTSIDE_DECODER]
    if ignored:
        _refuse(f"ignore list {ignored[:4]} leaves decoder projections unquantized")
    return scales.pop()
