"""Benchmark workloads: request lengths from fixed sizes or real traces, random token ids.

As NanoFlow does, requests are random token ids of the trace's lengths and generation
ignores EOS, so every request produces exactly its output length.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

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


# structured outputs' default benchmark constraint: an array of integers the grammar does
# not let close before 100,000 items (llguidance counts them lazily: no compile cost), so a
# constrained request runs to its output length like the others and the workloads compare
# like with like; without minItems a random model closes some arrays after a few tokens
DEFAULT_STRUCTURED_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 100000}


@dataclasses.dataclass(frozen=True)
class StructuredWorkload:
    """Which requests of a workload are constrained: `fraction` of them, spread evenly
    (structured_rows), each under the JSON schema `schema`."""
    fraction: float = 0.0
    schema: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_STRUCTURED_SCHEMA))

    def rows(self, num: int) -> list[bool]:
        return structured_rows(num, self.fraction)

    def constraint(self) -> dict:
        """The SamplingParams.structured_outputs of a constrained request."""
        return {"json": self.schema}


def structured_rows(num: int, fraction: float) -> list[bool]:
    """Request i is constrained where floor((i+1)F) > floor(iF): floor(num F) of them,
    evenly spread and the same every run (F 0.25: every fourth, from the fourth)."""
    return [math.floor((i + 1) * fraction) > math.floor(i * fraction) for i in range(num)]


def structured_fraction(text: str) -> float:
    """argparse type of --structured-fraction: a number in [0, 1] (not NaN)."""
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= f <= 1.0:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return f


def json_schema(text: str) -> dict:
    """argparse type of --structured-schema: a JSON object."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError("a JSON schema must be an object")
    return schema


def add_structured_args(p: argparse.ArgumentParser) -> None:
    """The offline benchmark's structured-outputs flags."""
    p.add_argument("--structured-fraction", type=structured_fraction, default=0.0,
                   metavar="F", help="constrain this fraction (0..1) of the requests, "
                   "evenly spread, with a JSON schema (--structured-schema); default 0")
    p.add_argument("--structured-schema", type=json_schema, default=None, metavar="JSON",
                   help="the constrained requests' JSON schema (default: "
                        f"{json.dumps(DEFAULT_STRUCTURED_SCHEMA)}: no request ends before "
                        "its output length)")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_DIR",
                   help="for a model without a tokenizer (random:<shape>): compile the "
                        "grammars against this one (a registered model name, or a directory "
                        "holding tokenizer.json); outputs are still not detokenized")


def load_tokenizer(name_or_dir: str, cache_dir=None):
    """--tokenizer: a registered model's tokenizer (its checkpoint imported if needed), or
    the one in a directory holding tokenizer.json (and tokenizer_config.json)."""
    from pathlib import Path

    from nanojax.errors import CheckpointError
    from nanojax.plugins import model_loader
    from nanojax.tokenizer import Tokenizer
    loader = model_loader()
    if name_or_dir in loader.REGISTERED:
        return loader.load_tokenizer(name_or_dir, cache_dir)
    path = Path(name_or_dir)
    if path.is_file():  # tokenizer.json itself
        path = path.parent
    try:
        return Tokenizer.load(path)
    except CheckpointError as e:
        raise NanojaxError(f"--tokenizer {name_or_dir}: not a registered model "
                           f"({', '.join(loader.REGISTERED)}) nor a tokenizer directory: "
                           f"{e}") from None


def structured_workload(args) -> StructuredWorkload:
    return StructuredWorkload(args.structured_fraction,
                              args.structured_schema or dict(DEFAULT_STRUCTURED_SCHEMA))


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
