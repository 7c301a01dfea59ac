"""The engine's host alone: its loop around a stand-in model (engine/mock_forward.py) with
the shapes of a real one, so what an iteration costs the CPU (scheduling, the step's
inputs, dispatch, reading tokens back, outputs) is seen without a GPU, at the running
counts a GPU serves (1,000 to 4,000 requests).

Each run keeps `running` requests decoding: 3x that many requests of `input_len` prompt
tokens and outputs spread over [output_len / 2, 3 output_len / 2] are queued at once,
with B_dense twice the running count (prompts fill what decodes leave, as the 8B's 2,048
for its ~1,000 decodes). The figures are the steady window's (bench/steady.py).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from nanojax.bench.steady import steady_state
from nanojax.engine.gc_freeze import frozen_startup_objects


@dataclasses.dataclass(frozen=True)
class HostBenchConfig:
    running: int = 1000           # requests decoding at once (max_num_seqs)
    input_len: int = 128
    output_len: int = 128         # mean output; each is drawn from [out/2, 3 out/2]
    shape: str = "llama3-8b"      # the model whose layer count the stand-in mimics
    vocab_size: int = 256         # the stand-in's (its logits and sampling stay small)
    page_size: int = 16
    seed: int = 0
    # requests under the structured benchmark's JSON schema (bench/workload.py), spread
    # evenly; their grammars compiled against `tokenizer`, whose vocabulary the stand-in's
    # is widened to (the masks are as wide as a real model's)
    structured_fraction: float = 0.0
    tokenizer: str = "smollm2-135m"
    detokenize: bool = False      # the engine holds the tokenizer: outputs carry text
    output_kind: str = "final_only"  # SamplingParams.output_kind (the server streams delta)
    async_dispatch: bool | None = None  # None: the platform's default (EngineConfig.resolve)


def run_host_bench(cfg: HostBenchConfig, profile: str | None = None) -> dict:
    """One engine run; the steady window's host figures. profile: a path for cProfile's
    stats of the window's iterations."""
    from nanojax.config import EngineConfig, named_shape
    from nanojax.engine.llm_engine import LLMEngine
    from nanojax.engine.mock_forward import MockForward, mock_params
    from nanojax.engine.sampling import SamplingParams
    from nanojax.models.bundle import ModelBundle

    from nanojax.bench.workload import StructuredWorkload, load_tokenizer
    structured = StructuredWorkload(cfg.structured_fraction)
    need_tokenizer = cfg.structured_fraction or cfg.detokenize
    tokenizer = load_tokenizer(cfg.tokenizer) if need_tokenizer else None
    vocab = max(cfg.vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
    model = dataclasses.replace(named_shape(cfg.shape), vocab_size=vocab)
    bundle = ModelBundle(model, mock_params(model.num_layers),
                         tokenizer if cfg.detokenize else None)
    max_len = cfg.input_len + cfg.output_len * 3 // 2 + 1
    pages_each = -(-max_len // cfg.page_size)
    engine_cfg = EngineConfig(
        b_dense=2 * cfg.running, max_num_seqs=cfg.running, page_size=cfg.page_size,
        num_pages=cfg.running * pages_each + 64, max_model_len=max_len, fixed_shapes=True,
        admission="predicted", enable_prefix_caching=False, step_cache=False,
        async_dispatch=cfg.async_dispatch)
    engine = LLMEngine(bundle, engine_cfg, forward=MockForward(model))
    if tokenizer is not None and not cfg.detokenize:  # (with it, the engine's own)
        engine.use_grammar_tokenizer(tokenizer)
    engine.runner.warmup()
    engine.stats.trace = []
    rng = np.random.default_rng(cfg.seed)
    lo, hi = cfg.output_len // 2, cfg.output_len * 3 // 2
    outputs = rng.integers(lo, hi + 1, 3 * cfg.running)
    for n, constrained in zip(outputs, structured.rows(len(outputs))):
        engine.add_request(rng.integers(0, cfg.vocab_size, cfg.input_len).tolist(),
                           SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True,
                                          output_kind=cfg.output_kind,
                                          structured_outputs=(structured.constraint()
                                                              if constrained else None)))
    mean_stay = float(outputs.mean()) + 1
    profiler = None
    start = time.perf_counter()
    with frozen_startup_objects(engine_cfg.gc_freeze):  # as the engine's own loops run
        while not engine.is_idle:
            if profile and profiler is None and engine.stats.steps >= mean_stay:
                import cProfile
                profiler = cProfile.Profile()
                profiler.enable()
            engine.step()
            if profiler is not None and engine.stats.steps == int(mean_stay) * 2:
                profiler.disable()
                profiler.dump_stats(profile)
    wall = time.perf_counter() - start
    ss = steady_state(engine.stats.trace, engine_cfg.b_dense, mean_stay)
    keys = ("mean_running", "mean_fill", "window_iterations", "host_ms_per_iteration",
            "schedule_ms_per_iteration", "launch_ms_per_iteration",
            "inputs_ms_per_iteration", "process_ms_per_iteration", "s_per_iteration",
            "device_wait_share")
    out = {"config": dataclasses.asdict(cfg), "iterations": engine.stats.steps,
           "wall_s": wall, **{k: ss.get(k) for k in keys},
           "async_dispatch": engine.runner.config.async_dispatch,
           # filling grammar masks (on the dispatch thread with async dispatch), per mask
           "mask_fill_ms": 1e3 * engine.runner.mask_s / max(1, engine.runner.num_masks),
           "finish_reasons": dict(engine.stats.finished)}
    if ss.get("window"):  # the median iteration: robust to another process's preemptions
        first, last = ss["window"]
        host = sorted(r.host_s for r in engine.stats.trace[first:last + 1])
        out["host_ms_p50"] = 1e3 * host[len(host) // 2]
    return out


def python_reference_ms(n: int = 20_000, repeats: int = 20) -> float:
    """A fixed pure-Python workload of the host loop's kind (attribute reads, list and
    dict work over objects that already exist, nothing allocated that the collector would
    chase): the in-process yardstick the host figures are divided by, so a test can ask
    whether the loop grew without asserting a wall-clock time. The best of `repeats`."""
    class Row:
        __slots__ = ("a", "b", "c")

        def __init__(self, i):
            self.a, self.b, self.c = i, [i, i + 1], {"k": i}

    rows = [Row(i) for i in range(n)]
    index = {id(r): i for i, r in enumerate(rows)}
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total = 0
        for r in rows:
            if r.a >= 0 and len(r.b) == 2:
                total += r.b[-1] + r.c["k"] + index[id(r)]
        best = min(best, time.perf_counter() - t)
    assert total > 0
    return 1e3 * best
