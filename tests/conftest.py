"""Shared fixtures. Everything runs on the CPU; GPU tests are marked `gpu` and skip."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Compiled programs are reused across test processes and CI runs on the same machine.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(os.environ.get("NANOJAX_CACHE",
                                              Path.home() / ".cache" / "nanojax")) / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# pyproject's -n 2 runs two pytest workers: on a GPU each would preallocate 75% of its
# memory and the second would fail; share it out instead (CPU runs ignore this)
if (_workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.75 / _workers:.3f}")


def _has_gpu() -> bool:
    try:
        import jax
        return jax.default_backend() == "gpu"
    except Exception:
        return False


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each module's compiled steps, engines and caches go with it: two pytest workers
    (pyproject's -n 2) share the suite on a 24 GB machine, and jax keeps every executable
    it compiled (the persistent cache on disk keeps recompiles cheap)."""
    yield
    import gc
    try:
        import jax
        jax.clear_caches()
    except Exception:  # noqa: BLE001 - jax missing or not initialised: nothing to free
        pass
    gc.collect()
    try:  # glibc keeps freed memory in its arenas: hand it back to the system (a module
        # left ~1-2 GB more behind without it; two workers each carry what they keep)
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def pytest_collection_modifyitems(config, items):
    if not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (f32), imported once into the user cache."""
    from checkpoints.loader import load_model
    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2):
    from checkpoints.embedded import cache_dir, smollm2_gguf
    return smollm2_gguf(cache_dir())


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own GGUF import of the same file: the independent implementation."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = Path(smollm2_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def tiny_bundle():
    """A 2-layer random model: fast compiles for scheduler and sampling tests."""
    from checkpoints.loader import load_model
    return load_model("random:tiny", dtype="float32")
