"""What nanojax finds through entry points instead of importing it: the model loader
(a model name or path -> ModelBundle: checkpoints/loader.py) and extra subcommands
(search/cli.py). pyproject.toml declares them, so the arrows between the top-level
packages point one way: checkpoints/ and search/ import nanojax, never the reverse
(tests/test_layout.py checks it). pytest and vLLM find their plugins the same way.

Installed (`pip install -e .`), the entry points come from the package's metadata; run
from a source tree that was not installed (`PYTHONPATH=. python3 -m nanojax`, as the GPU
scripts do), from that tree's pyproject.toml.
"""
from __future__ import annotations

import functools
import tomllib
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from nanojax.errors import NanojaxError

if TYPE_CHECKING:
    import os

    from nanojax.models.bundle import ModelBundle
    from nanojax.tokenizer import Tokenizer

LOADERS = "nanojax.loaders"
COMMANDS = "nanojax.commands"
SOURCE_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


class ModelLoader(Protocol):
    """What nanojax asks of the package that reads weights (a module satisfies it)."""

    REGISTERED: Mapping[str, str]  # the model names it knows -> a description

    def load_model(self, model: str, dtype: str | None = None, cache_dir=None,
                   num_layers: int | None = None, tensor_parallel_size: int = 1,
                   quantization: str | None = None) -> ModelBundle:
        """A registered name, `random:<shape>` or a path, loaded (straight into its
        shards under tensor parallelism) and quantized as asked."""

    def convert(self, src: str | os.PathLike, dst: str | os.PathLike,
                dtype: str = "float32", overwrite: bool = False,
                quantization: str | None = None,
                calibration: list[str] | list[list[int]] | None = None) -> Path:
        """Writes src as a nanojax checkpoint at dst, its projections quantized as asked
        (with calibration, FP8 with static activation scales calibrated on those texts
        or token-id sequences); returns dst."""

    def load_tokenizer(self, model: str, cache_dir=None) -> Tokenizer:
        """A registered model's tokenizer, without its weights."""

    def gguf_file(self, model: str, cache_dir=None) -> Path | None:
        """The GGUF file the model's weights come from (fetched if needed), or None."""


class PluginError(NanojaxError):
    """An entry point nanojax needs is not installed."""


def _entry_points(group: str) -> list[EntryPoint]:
    found = list(entry_points(group=group))
    if found or not SOURCE_PYPROJECT.is_file():
        return found
    with open(SOURCE_PYPROJECT, "rb") as f:
        project = tomllib.load(f).get("project", {})
    if project.get("name") != "nanojax":
        return []
    declared = project.get("entry-points", {}).get(group, {})
    return [EntryPoint(name, value, group) for name, value in declared.items()]


@functools.cache
def model_loader() -> ModelLoader:
    """The installed model loader (checkpoints/loader.py); exactly one is expected."""
    found = _entry_points(LOADERS)
    if len(found) != 1:
        raise PluginError(
            f"nanojax needs one model loader (entry point group {LOADERS!r}) and found "
            f"{len(found)}{': ' + ', '.join(e.value for e in found) if found else ''}; "
            "reinstall with `pip install -e .` in the nanojax checkout")
    return found[0].load()


def commands() -> list[Callable]:
    """The register(subparsers) functions of the installed extra subcommands, by name."""
    return [ep.load() for ep in sorted(_entry_points(COMMANDS), key=lambda e: e.name)]
