"""The step executable cache (nanojax/step_cache.py): a second engine start loads its step
shapes instead of tracing them, runs the same tokens, and a bad or foreign entry compiles."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanojax.config import EngineConfig, KernelConfig
from nanojax.engine.forward import ScanForward, UnrolledForward
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.sampling import SamplingParams
from nanojax.layers.attention import pallas_backend
from nanojax.step_cache import MAGIC, SUBDIR, StepCache, describe


@pytest.fixture
def cache_dir(tmp_path):
    """jax's cache directory pointed at tmp_path for the step cache (jax's own cache has
    already opened the shared one: a compile first), restored after."""
    jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready()
    saved = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path / SUBDIR
    jax.config.update("jax_enable_compilation_cache", saved[0])
    jax.config.update("jax_compilation_cache_dir", saved[1])


def start(bundle, kernels=KernelConfig(), requests=True, b_dense=32, compile_threads=1,
          **engine):
    """An engine start as `serve` makes it (fixed shapes, every bucket at warmup), then a
    few greedy requests: (tokens, shapes traced, runner). engine: more EngineConfig."""
    eng = LLMEngine(bundle, EngineConfig(b_dense=b_dense, num_pages=64, max_model_len=64,
                                         max_num_seqs=4, fixed_shapes=True, kernels=kernels,
                                         step_cache=True, compile_threads=compile_threads,
                                         **engine),
                    forward=ScanForward(bundle.config))
    traced = eng.runner.warmup()
    if not requests:
        return None, traced, eng.runner
    rng = np.random.default_rng(3)
    ids = [eng.add_request(rng.integers(0, 500, size=int(n)).tolist(),
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
           for n in (3, 20, 40)]
    done = eng.run_to_completion()
    return [done[i].token_ids for i in ids], traced, eng.runner


def test_second_start_loads_every_step_shape_and_runs_the_same_tokens(tiny_bundle,
                                                                      cache_dir):
    tokens, traced, runner = start(tiny_bundle)
    assert traced == 2 and runner.num_loaded == 0  # buckets 16 and 32
    assert runner.step_cache.stored == 2 and len(list(cache_dir.iterdir())) == 2
    tokens2, traced2, runner2 = start(tiny_bundle)
    assert traced2 == 0 and runner2.num_compiles == 0  # nothing traced, start to finish
    assert runner2.num_loaded == 2
    assert tokens2 == tokens
    # an entry names what it holds (the two in whatever order the directory lists them)
    keys = []
    for entry in sorted(cache_dir.iterdir()):
        data = entry.read_bytes()
        assert data.startswith(MAGIC)
        n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
        keys.append(json.loads(data[len(MAGIC) + 8:len(MAGIC) + 8 + n])["key"])
    for key in keys:
        for part in ('"jaxlib"', '"device_kind"', '"num_devices"', '"source"', "ScanForward",
                     '"b_dense": 32', '"prefill_block_q": 16'):
            assert part in key, part
    # the token bucket's shape: 16 in one entry, 32 in the other
    assert sorted("int32[16]" in k for k in keys) == [False, True]


def test_warmup_in_threads_compiles_every_shape_once_and_runs_the_same_tokens(
        tiny_bundle, cache_dir):
    """B_dense 128: buckets 16-128, the largest first, the other three in three threads;
    jax's cache setting that a fresh compile holds off is restored after."""
    setting = jax.config.jax_persistent_cache_min_compile_time_secs
    tokens, traced, runner = start(tiny_bundle, b_dense=128, compile_threads=3)
    assert traced == 4 and runner.step_cache.stored == 4 and runner.num_loaded == 0
    assert jax.config.jax_persistent_cache_min_compile_time_secs == setting
    tokens_seq, traced_seq, runner_seq = start(tiny_bundle, b_dense=128)
    assert traced_seq == 0 and runner_seq.num_loaded == 4  # the threads' entries load
    assert tokens_seq == tokens
    # threads or not is not part of the program: both starts share the entries
    assert len(list(cache_dir.iterdir())) == 4


def test_host_only_settings_share_the_step_entries(tiny_bundle, cache_dir):
    """Settings that steer only the host (config.HOST_ONLY_FIELDS: admission, the fit
    and the prefill spread, the token buckets' step, async scheduling and dispatch, the
    seed, prefix caching, the collector) are left out of the key: a start that changes
    them all loads the first start's steps (an A/B of one on a GPU traces nothing again)
    and runs the same greedy tokens; the rest of the engine's config is still in it (a
    kernel option that leaves every argument shape as it was misses)."""
    from nanojax.config import HOST_ONLY_FIELDS
    tokens, traced, _ = start(tiny_bundle)
    assert traced == 2
    host = dict(admission="predicted", fit_step_shapes=False, prefill_spread=4,
                token_bucket_step=8, min_token_bucket=8, async_scheduling=False,
                async_dispatch=True, seed=5, enable_prefix_caching=False, gc_freeze=False,
                compile_threads=2)
    assert set(host) | {"step_cache"} == set(HOST_ONLY_FIELDS)
    tokens2, traced2, runner2 = start(tiny_bundle, **host)
    assert runner2.token_buckets() == [8, 16, 24, 32]  # 16 and 32 load, 8 and 24 trace
    assert traced2 == 2 and runner2.num_loaded == 2
    assert tokens2 == tokens
    _, traced3, runner3 = start(tiny_bundle, KernelConfig(merge_dots=True), requests=False)
    assert traced3 == 2 and runner3.num_loaded == 0


def test_corrupt_or_foreign_entries_compile_and_a_changed_config_misses(tiny_bundle,
                                                                        cache_dir):
    """One step shape (B_dense 16) per start; K2 differs from K1 in one kernel option."""
    k1, k2 = KernelConfig(), KernelConfig(prefill_block_q=8)
    start(tiny_bundle, k1, requests=False, b_dense=16)
    (first,) = cache_dir.iterdir()
    _, traced, runner = start(tiny_bundle, k2, requests=False, b_dense=16)
    assert traced == 1 and runner.num_loaded == 0 and runner.step_cache.dropped == 0
    (second,) = set(cache_dir.iterdir()) - {first}
    # K1's entry under K2's name; a flipped byte in K1's executable
    blob = bytearray(first.read_bytes())
    second.write_bytes(bytes(blob))
    blob[-100] ^= 0xFF
    first.write_bytes(bytes(blob))
    for k in (k1, k2):
        _, traced, runner = start(tiny_bundle, k, requests=False, b_dense=16)
        assert traced == 1 and runner.num_loaded == 0 and runner.step_cache.dropped == 1
    # rewritten: the next start loads it
    _, traced, runner = start(tiny_bundle, k1, requests=False, b_dense=16)
    assert traced == 0 and runner.num_loaded == 1


def test_the_gpu_forward_describes_the_same_in_every_process(tiny_bundle):
    """No object addresses in the key (they differ each start: every start would miss)."""
    def gpu():
        return json.dumps(describe(UnrolledForward(tiny_bundle.config, attention=(
            pallas_backend(KernelConfig(decode_kernel="mosaic"))))))
    text = gpu()
    assert "0x" not in text and "attend_pallas" in text and '"mosaic"' in text
    assert text == gpu()


def test_prune_keeps_the_most_recently_used_entries(tmp_path):
    cache = StepCache(tmp_path, {"program": 1}, jax.devices()[:1])
    for i in range(5):
        (tmp_path / f"e{i}").write_bytes(b"x")
        os.utime(tmp_path / f"e{i}", (i, i))
    (tmp_path / ".tmp-partial").write_bytes(b"x")  # another process's write in flight
    cache.prune(keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-partial", "e3", "e4"]
    assert describe(np.float32(0.5)) == 0.5 and describe(np.int64(3)) == 3
