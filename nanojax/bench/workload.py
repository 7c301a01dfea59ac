"""Benchmark workloads: request lengths from fixed sizes or real traces, random token ids.

As NanoFlow does, requests are random token ids of the trace's lengths and generation
ignores EOS, so every request produces exactly its output length.
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from nanojax.errors import NanojaxError
from nanojax.traces import TRACES, trace_lengths  # noqa: F401 (re-exported)

@dataclasses.dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


def make_requests(num: int, vocab_size: int, input_len: int | None = None,
                  output_len: int | None = None, trace: str | None = None,
                  max_model_len: int | None = None, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    if trace is not None:
        lengths = trace_lengths(trace)
        if max_model_len:  # keep requests that fit, as a server would have to
            lengths = [(p, o) for p, o in lengths if p + o <= max_model_len and p > 0 and o > 0]
        if not lengths:
            raise NanojaxError(f"no request of trace {trace} fits max_model_len {max_model_len}")
        picks = rng.choice(len(lengths), size=num, replace=len(lengths) < num)
        pairs = [lengths[i] for i in picks]
    else:
        if input_len is None or output_len is None:
            raise NanojaxError("give --trace or both --input-len and --output-len")
        pairs = [(input_len, output_len)] * num
    # avoid the first ids (special tokens in most vocabularies)
    low = min(1000, vocab_size // 2)
    return [BenchRequest(rng.integers(low, vocab_size, size=p).tolist(), o) for p, o in pairs]


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags of the offline and online benchmarks."""
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--trace", default=None,
                   help="splitwise, lmsys, sharegpt, or a TIMESTAMP,ContextTokens,"
                        "GeneratedTokens CSV")
    p.add_argument("--seed", type=int, default=0)


@dataclasses.dataclass
class Conversation:
    """A multi-round chat: each turn appends the previous answer and a new user message to
    the context, so every returning turn repeats the whole history as its prefix."""
    turns: list[tuple[list[int], int]]   # (new user message ids, output length) per turn


def make_conversations(num: int, rounds: int, vocab_size: int, input_len: int | None = None,
                       output_len: int | None = None, trace: str | None = None,
                       max_model_len: int | None = None, seed: int = 0) -> list[Conversation]:
    """`num` conversations of up to `rounds` turns; each turn's (user message, answer)
    lengths are drawn from the trace (or fixed). A conversation stops early where its next
    turn would outgrow max_model_len, as a chat would have to."""
    if rounds < 1:
        raise NanojaxError(f"a conversation needs at least one round, got {rounds}")
    pool = make_requests(num * rounds, vocab_size, input_len, output_len, trace,
                         max_model_len, seed)
    convs = []
    for c in range(num):
        turns, context = [], 0
        for r in pool[c * rounds:(c + 1) * rounds]:
            if max_model_len and context + len(r.prompt_ids) + r.output_len > max_model_len:
                break
            turns.append((r.prompt_ids, r.output_len))
            context += len(r.prompt_ids) + r.output_len
        convs.append(Conversation(turns))
    return convs
