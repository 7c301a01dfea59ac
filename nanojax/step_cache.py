"""Compiled step executables kept on disk, so that a warm start skips tracing and lowering.

jax's persistent cache (compile_cache.py) saves the backend compile, but finds its entry
only after tracing the Python step and lowering it to StableHLO: for the 8B GPU step, 8
shapes of 32 straight-line layers with Pallas kernels, that is a large part of a warm
start (measured: bench/results/log/engine_host.md). Here an entry is the serialized
executable itself, found by a digest of everything that determines the program: the
caller's description (model and engine config, forward, kernels, plan), the step's
argument shapes, dtypes and shardings, jax and jaxlib, the backend, device kind and count,
and nanojax's own source.

It lives in `<compile cache dir>/nanojax-steps`, on only where jax's cache is on (the
`--compile-cache-dir` / `--no-compile-cache` flags; `--no-step-cache`,
EngineConfig.step_cache, turns off this part alone). An entry is written atomically and
carries its key and a checksum; one that is unreadable, corrupt or of another key is
dropped and the step compiles as usual.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import pickle
import tempfile
import threading
import types
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger("nanojax.step_cache")
MAGIC = b"nanojax-step-v1\n"
SUBDIR = "nanojax-steps"
# entries kept, the least recently used dropped beyond it: every edit of nanojax's source
# makes new keys (a GPU serve start stores one entry per token bucket, 8 at B_dense 2048)
MAX_ENTRIES = 128
# attributes that are not part of the compiled program: counters a forward keeps while
# it runs (EngineConfig's host-only settings: config.HOST_ONLY_FIELDS, left out by the
# engine's description)
RUNTIME = ("num_traces",)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """Of nanojax's and the kernels' Python source: an edited forward is another program."""
    here = Path(__file__).resolve().parent  # nanojax/, beside it pallas_kernels/
    h = hashlib.sha256()
    for root in (here, here.parent / "pallas_kernels"):
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def environment(devices) -> dict:
    import jaxlib
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(),
            "platform_version": devices[0].client.platform_version,
            "device_kind": devices[0].device_kind, "num_devices": jax.device_count(),
            "program_devices": [d.id for d in devices],
            "num_processes": jax.process_count(), "source": source_digest()}


def describe_args(args) -> str:
    """The step's argument structure and every leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return str(tree) + "|" + ";".join(
        f"{jax.typeof(x) if hasattr(jax, 'typeof') else jax.core.get_aval(x)}"
        f"@{getattr(x, 'sharding', None)}" for x in leaves)


def describe(obj, depth: int = 6):
    """A stable, address-free description of a config or forward object: dataclasses and
    plain objects by their fields, functions and partials by name and bound arguments,
    arrays by shape and dtype (their values follow from the configs described beside)."""
    if isinstance(obj, (str, int, float, bool, type(None))):
        return obj
    if isinstance(obj, np.generic):  # a numpy scalar: its value, not an "array"
        return obj.item()
    if depth == 0:
        return type(obj).__qualname__
    d = lambda x: describe(x, depth - 1)  # noqa: E731
    if isinstance(obj, functools.partial):
        return {"partial": d(obj.func), "args": [d(a) for a in obj.args],
                "keywords": {k: d(v) for k, v in sorted(obj.keywords.items())}}
    if isinstance(obj, (type, types.FunctionType, types.MethodType,
                        types.BuiltinFunctionType)):
        return f"{getattr(obj, '__module__', '')}.{obj.__qualname__}"
    if isinstance(obj, dict):
        return {str(k): d(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return [d(x) for x in items]
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"array{tuple(obj.shape)}:{obj.dtype}"
    if dataclasses.is_dataclass(obj):
        return {"type": type(obj).__qualname__,
                **{f.name: d(getattr(obj, f.name, None)) for f in dataclasses.fields(obj)
                   if f.name not in RUNTIME}}
    if hasattr(obj, "__dict__"):
        return {"type": type(obj).__qualname__,
                **{k: d(v) for k, v in sorted(vars(obj).items())
                   if not k.startswith("_") and k not in RUNTIME}}
    return type(obj).__qualname__



@functools.cache
def load_kernel_runtimes() -> None:
    """A stored program with Mosaic GPU kernels finds their host runtime (the TMA
    descriptor and launch symbols) through the library path that jax's Mosaic GPU module
    sets when imported; tracing a kernel imports it, loading a stored step does not (H200,
    2026-12-02: "Symbols not found: [ mosaic_gpu_init_tma_desc, mosaic_gpu_launch_kernel ]"
    for the step shape holding the Mosaic decode kernel, recompiled on every start)."""
    if jax.default_backend() != "gpu":
        return
    try:
        importlib.import_module("jax.experimental.mosaic.gpu")
    except ImportError:  # a jaxlib without Mosaic GPU has no such kernels to load
        pass

class StepCache:
    """Serialized executables of one program (description) by argument signature, run on
    devices (the program's, in order)."""

    def __init__(self, directory: str | os.PathLike, description: dict, devices):
        self.dir = Path(directory)
        self.devices = list(devices)
        self.base = json.dumps({"program": description, "env": environment(self.devices)},
                               sort_keys=True, default=repr)
        self.loaded = self.stored = self.dropped = 0
        self._count_lock = threading.Lock()  # warm-up loads and stores from threads

    def _count(self, name: str) -> None:
        with self._count_lock:
            setattr(self, name, getattr(self, name) + 1)

    @classmethod
    def from_jax_config(cls, description: dict, devices) -> "StepCache | None":
        """Beside jax's persistent cache; None where that is off."""
        if not jax.config.jax_enable_compilation_cache:
            return None
        root = jax.config.jax_compilation_cache_dir
        return cls(Path(root) / SUBDIR, description, devices) if root else None

    def key(self, args) -> tuple[str, str]:
        text = self.base + "\n" + describe_args(args)
        return hashlib.sha256(text.encode()).hexdigest(), text

    def load(self, args):
        """The jax.stages.Compiled stored for args, or None (a missing entry, or a bad one,
        which is removed)."""
        digest, text = self.key(args)
        path = self.dir / digest
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            if not data.startswith(MAGIC):
                raise ValueError("not a step cache entry")
            header_len = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
            start = len(MAGIC) + 8
            header = json.loads(data[start:start + header_len])
            payload = data[start + header_len:]
            if header["key"] != text:
                raise ValueError("another program's entry")
            if hashlib.sha256(payload).hexdigest() != header["sha256"]:
                raise ValueError("checksum mismatch")
            from jax.experimental.serialize_executable import deserialize_and_load
            load_kernel_runtimes()
            serialized, in_tree, out_tree = pickle.loads(payload)
            compiled = deserialize_and_load(serialized, in_tree, out_tree,
                                            execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 - any bad entry: compile instead
            log.warning("step cache entry %s unusable (%s: %s); compiling", path.name,
                        type(e).__name__, e)
            self._count("dropped")
            path.unlink(missing_ok=True)
            return None
        self._count("loaded")
        try:
            os.utime(path)  # recently used: kept by prune()
        except OSError:
            pass
        return compiled

    def store(self, args, compiled) -> None:
        """Writes compiled for args (atomically); a program that cannot be serialized or a
        failed write only logs."""
        digest, text = self.key(args)
        try:
            from jax.experimental.serialize_executable import serialize
            payload = pickle.dumps(serialize(compiled))
            header = json.dumps({"key": text,
                                 "sha256": hashlib.sha256(payload).hexdigest()}).encode()
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + len(header).to_bytes(8, "little") + header + payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.dir / digest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except Exception as e:  # noqa: BLE001 - the step runs; only the next start pays
            log.warning("step executable not cached (%s: %s)", type(e).__name__, e)
            return
        self._count("stored")
        self.prune()

    def prune(self, keep: int = MAX_ENTRIES) -> None:
        """Drops the least recently used entries beyond keep (another process may be
        dropping the same ones)."""
        try:
            entries = [(p.stat().st_mtime, p) for p in self.dir.iterdir()
                       if not p.name.startswith(".")]
        except OSError:
            return
        for _, p in sorted(entries, reverse=True)[keep:]:
            p.unlink(missing_ok=True)


# An executable jax's persistent cache loaded cannot be serialized again in full (XLA:CPU
# drops its object code: the re-loaded program fails with "Function ... not found"). An
# entry must hold a fresh compile, so a miss compiles with one option set, to its default,
# that only changes jax's cache key (XLA embeds no IR in the executable either way), and
# keeps that compile out of jax's cache (else a lost entry could never be refilled)
FRESH_COMPILE = {"xla_embed_ir_in_executable": False}
_jax_cache_hits = [0]


@functools.lru_cache(maxsize=1)
def _count_jax_cache_hits() -> None:
    def listen(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _jax_cache_hits[0] += 1
    jax.monitoring.register_event_listener(listen)


_fresh_lock = threading.Lock()
_fresh_compiles = [0, None]  # compiles under way, jax's setting before the first


@contextlib.contextmanager
def _out_of_jax_cache():
    """jax's persistent cache skips writes while any fresh compile runs (the setting is
    process-wide: the first compile in sets it, the last out restores it, so compiles in
    several threads cannot leave it set)."""
    name = "jax_persistent_cache_min_compile_time_secs"
    with _fresh_lock:
        if _fresh_compiles[0] == 0:
            _fresh_compiles[1] = getattr(jax.config, name)
            jax.config.update(name, float("inf"))
        _fresh_compiles[0] += 1
    try:
        yield
    finally:
        with _fresh_lock:
            _fresh_compiles[0] -= 1
            if _fresh_compiles[0] == 0:
                jax.config.update(name, _fresh_compiles[1])


def compile_fresh(jitted, args):
    """jitted compiled for args -> (compiled, fresh: not loaded from jax's cache).
    Thread-safe (warm-up compiles step shapes in several threads)."""
    _count_jax_cache_hits()
    hits = _jax_cache_hits[0]
    lowered = jitted.lower(*args)
    with _out_of_jax_cache():  # another thread's compile meanwhile: unwritten there too
        compiled = lowered.compile(compiler_options=FRESH_COMPILE)
    # another thread's hit meanwhile only skips a store
    return compiled, _jax_cache_hits[0] == hits


class CachedJit:
    """A jitted function whose executables come from a StepCache when it has them, and go
    to it when compiled here. Called with a cheap key (the runner's step shape) that
    determines every argument's shape; the full signature is read once per key."""

    def __init__(self, jitted, cache: StepCache):
        self.jitted, self.cache = jitted, cache
        self._compiled = {}

    def __call__(self, key, *args):
        return self.prepare(key, *args)(*args)

    def prepare(self, key, *args):
        """The executable for key, loaded or compiled (and stored), without running it;
        distinct keys may be prepared from several threads at once."""
        fn = self._compiled.get(key)
        if fn is None:
            fn = self.cache.load(args)
            if fn is None:
                fn, fresh = compile_fresh(self.jitted, args)
                if fresh:
                    self.cache.store(args, fn)
                else:
                    log.warning("step executable not cached: jax's cache supplied it")
            self._compiled[key] = fn
        return fn
