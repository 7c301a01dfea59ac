"""CLI flags generated from the config dataclasses, so each option is declared once.

Every field of EngineConfig (and of its KernelConfig) becomes a flag named after it
(`b_dense` -> `--b-dense`, or the field's `flag` metadata), with the field's help text and
choices; booleans get `--x/--no-x`. generate, serve and bench all call
`add_engine_args` and build their config with `engine_config_from_args`, which also
checks the values (the dataclasses validate themselves).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

from nanojax.config import QUANTIZATIONS, EngineConfig, KernelConfig
from nanojax.errors import ConfigError


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Which model to load: shared by every command that loads one."""
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name (smollm2-135m), random:<shape>, or a path to a "
                        "nanojax checkpoint, GGUF file or HF directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameter dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: the dense projections' weights in e4m3 with per-channel "
                        "scales and activations quantized per token (W8A8, quantized at "
                        "load); an FP8 checkpoint (compressed-tensors, 'fp8') is FP8 "
                        "without it, a block-wise one requantized per channel. fp8-block: "
                        "one weight scale per 128 x 128 block and activations per 128-wide "
                        "group (dense models; a block-wise checkpoint's blocks kept). The "
                        "LM head and embeddings stay in --dtype")
    p.add_argument("--cache-dir", default=None,
                   help="where the default model is cached (env NANOJAX_CACHE)")
    from nanojax import compile_cache
    compile_cache.add_args(p)


def apply_gpu_memory_utilization(args: argparse.Namespace) -> float | None:
    """--gpu-memory-utilization (EngineConfig.memory_utilization) as jax's allocator reads
    it: its pool is sized when the backend starts, so this runs first. Returns the share in
    force (None: the command loads no model); the environment's, where set, is kept."""
    import os
    if not hasattr(args, "model"):
        return None
    chosen = getattr(args, "memory_utilization", EngineConfig.memory_utilization)
    if not 0 < chosen <= 1:  # (NaN too) before jax reads it
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {chosen}")
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():  # (main() called again in one process)
        import logging
        logging.getLogger("nanojax").warning(
            "jax's backend has started: --gpu-memory-utilization %s is not applied to its "
            "allocator", chosen)
        return None
    from nanojax.engine.kv_cache import MEM_FRACTION_ENV, pool_share
    if any(os.environ.get(env) for env in MEM_FRACTION_ENV):
        return pool_share()  # the user's (the KV cache still keeps to `chosen`)
    os.environ[MEM_FRACTION_ENV[0]] = str(chosen)
    return chosen


def _parsed(convert, s: str, expected: str):
    """argparse says "invalid <function name> value" for a ValueError: name the expectation."""
    try:
        return convert(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}") from None


def integer(s: str) -> int:
    return _parsed(int, s, "an integer")


def number(s: str) -> float:
    return _parsed(float, s, "a number")


def positive_int(s: str) -> int:
    v = _parsed(int, s, "a positive integer")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def non_negative_float(s: str) -> float:
    v = _parsed(float, s, "a number >= 0")
    if not v >= 0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {s!r}")
    return v


def positive_seconds(s: str) -> float:
    v = _parsed(float, s, "a number of seconds > 0")
    if not 0 < v < 1e9:  # NaN and infinity fail too (a timer takes neither)
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {s!r}")
    return v


def token_ids_list(s: str) -> list[int]:
    ids = _parsed(lambda t: [int(x) for x in t.split(",")], s,
                  "comma-separated token ids such as 1,2,3")
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {s!r}")
    return ids


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(s: str) -> int:
    """A byte count: 4096, 512M, 64G (powers of 1024)."""
    t = s.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        v = float(t[:-1] if unit else t) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {s!r} (e.g. 4096, 512M, 64G)")
    if v < 0:
        raise argparse.ArgumentTypeError(f"a byte count must be >= 0, got {s}")
    return int(v)


_PARSERS = {"bytes": parse_bytes}


def _flag(field: dataclasses.Field) -> str:
    return "--" + field.metadata.get("flag", field.name.replace("_", "-"))


def _scalar_type(tp):
    """int / float / str / bool of a field annotation such as `int | None`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _add_fields(parser, cls, dest_prefix: str, skip: tuple[str, ...],
                only: tuple[str, ...] | None = None) -> None:
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        if only is not None and f.name not in only:
            continue
        tp = _scalar_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            _add_fields(parser, tp, f"{dest_prefix}{f.name}.", skip)
            continue
        text = f.metadata.get("help", "")
        if f.default is not None:
            text += f" (default: {f.default})"
        kw = {"dest": dest_prefix + f.name, "default": argparse.SUPPRESS, "help": text}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _PARSERS.get(f.metadata.get("parse"), tp)
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            else:
                kw["metavar"] = {int: "N", float: "X"}.get(tp, "S")
        group.add_argument(_flag(f), **kw)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                    kernels_only: bool = False, only: tuple[str, ...] | None = None) -> None:
    """Flags for every EngineConfig field (kernels_only: KernelConfig's alone; only: just
    these EngineConfig fields), except `skip`. Unset flags keep the dataclass default."""
    if kernels_only:
        _add_fields(parser, KernelConfig, "kernels.", skip)
    else:
        _add_fields(parser, EngineConfig, "", skip, only)


def _given(args: argparse.Namespace, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in vars(args).items()
            if k.startswith(prefix) and "." not in k[len(prefix):]}


def kernel_config_from_args(args: argparse.Namespace, **overrides) -> KernelConfig:
    return KernelConfig(**{**_given(args, "kernels."), **overrides})


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of the parsed flags; overrides win (values a command fixes)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    # a flag left unset where a command's default is None: the field's own default
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    try:
        return EngineConfig(**{**given, "kernels": kernel_config_from_args(args),
                               **overrides})
    except TypeError as e:
        raise ConfigError(f"bad engine options: {e}") from None
