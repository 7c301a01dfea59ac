"""The runtime's native checkpoint: a directory with config.json, the tokenizer files and
an orbax PyTree checkpoint of the parameters under params/.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from checkpoints.generation_config import read_generation_config, write_generation_config
from checkpoints.bundle import cast_tree, check_fp8_values, check_tree, param_dtypes
from nanojax.config import ModelConfig
from nanojax.errors import CheckpointError
from nanojax.models.bundle import ModelBundle
from nanojax.tokenizer import Tokenizer

FORMAT_FILE = "nanojax_checkpoint.json"
FORMAT_VERSION = 1


def is_orbax_checkpoint(path: Path) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()


def save_orbax(bundle: ModelBundle, dst: Path, overwrite: bool = False) -> Path:
    """Writes into a temporary sibling, then renames: no half-written checkpoint remains."""
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise CheckpointError(f"destination {dst} already exists (use --overwrite)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=dst.parent))
    try:
        bundle.config.save(tmp / "config.json")
        if bundle.tokenizer is not None:
            bundle.tokenizer.save(tmp)
        write_generation_config(tmp, bundle.sampling_defaults)
        params = jax.tree_util.tree_map(np.asarray, bundle.params)
        ckptr = ocp.PyTreeCheckpointer()
        ckptr.save(tmp / "params", params)
        (tmp / FORMAT_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION}))
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def load_orbax(path: Path, dtype: str | None = None,
               tensor_parallel_size: int = 1) -> ModelBundle:
    """tensor_parallel_size > 1: each parameter is restored straight into its shards."""
    import orbax.checkpoint as ocp

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not is_orbax_checkpoint(path):
        raise CheckpointError(f"{path} is not a nanojax checkpoint (no {FORMAT_FILE})")
    meta = json.loads((path / FORMAT_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {meta.get('format_version')}, "
                              f"this nanojax reads {FORMAT_VERSION}")
    cfg = ModelConfig.load(path / "config.json")
    if not (path / "params").is_dir():
        raise CheckpointError(f"checkpoint {path} lacks its params/ directory")
    if tensor_parallel_size != 1:
        return _load_orbax_sharded(path, cfg, dtype, tensor_parallel_size)
    try:
        params = ocp.PyTreeCheckpointer().restore(path / "params")
    except Exception as e:
        raise CheckpointError(f"corrupt parameters in {path / 'params'}: "
                              f"{type(e).__name__}: {e}") from None
    params = jax.tree_util.tree_map(np.asarray, params)
    check_tree(cfg, params)
    check_fp8_values(cfg, params)
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
        params = cast_tree(cfg, params)  # FP8 weights and their scales keep their dtypes
    tok = Tokenizer.load(path) if (path / "tokenizer.json").is_file() else None
    return ModelBundle(cfg, params, tok, sampling_defaults=read_generation_config(path)[0])


def _load_orbax_sharded(path: Path, cfg: ModelConfig, dtype: str | None,
                        tp: int) -> ModelBundle:
    """Restores every array into the shardings tensor parallelism gives it (each device
    reads its slice; no whole array on one device), in the requested dtype."""
    import orbax.checkpoint as ocp

    from nanojax.parallel.tp import model_shardings
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    shardings = model_shardings(cfg, tp)
    args = jax.tree_util.tree_map(lambda s, dt: ocp.ArrayRestoreArgs(sharding=s, dtype=dt),
                                  shardings, param_dtypes(cfg))
    try:
        params = ocp.PyTreeCheckpointer().restore(path / "params", restore_args=args)
    except Exception as e:
        raise CheckpointError(f"corrupt parameters in {path / 'params'} (or not of this "
                              f"config's tree): {type(e).__name__}: {e}") from None
    check_tree(cfg, params)
    check_fp8_values(cfg, params)  # on the devices: no array gathered to the host
    tok = Tokenizer.load(path) if (path / "tokenizer.json").is_file() else None
    return ModelBundle(cfg, params, tok, sampling_defaults=read_generation_config(path)[0])
