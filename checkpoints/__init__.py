"""Weights in and out: GGUF and HF imports, the orbax native format, random init."""
from checkpoints.bundle import ModelBundle
from checkpoints.loader import convert, load_model

__all__ = ["ModelBundle", "convert", "load_model"]
