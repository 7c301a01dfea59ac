"""Flax model definitions."""
from nanojax.models.llama import DecoderLayer, LlamaForCausalLM, init_params, param_shapes

__all__ = ["DecoderLayer", "LlamaForCausalLM", "init_params", "param_shapes"]
