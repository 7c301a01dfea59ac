"""Weights in and out: GGUF and HF imports, the orbax native format, random init."""
from checkpoints.loader import convert, load_model
from nanojax.models.bundle import ModelBundle  # what load_model returns

__all__ = ["ModelBundle", "convert", "load_model"]
