"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice,
Lark/GBNF grammar) compiled by llguidance, one matcher per constrained request, and the
packed token bitmask the sampler applies on the device (sampling.apply_bitmask).

Where the mask is computed: a row's mask for step i+1 depends on its token of step i. With
async scheduling that token is still on the device when step i+1 is formed, so (as vLLM
and SGLang do) a constrained step is split: the engine dispatches step i+1's forward,
then reads step i's tokens and advances the matchers while the device runs that forward;
the mask is filled and step i+1's sampler dispatched after (LLMEngine.step,
runner.MaskedStep). With async dispatch (the GPU default) the fill and the mask's copy
run on the runner's dispatch thread (llguidance fills rows in its own threads, without
the GIL) while the engine thread schedules the next iteration. A step with no
constrained row is launched as before, with no mask and no extra sampler variant.

A step's masks cover its constrained rows only (GrammarMasks: the rows' masks and their
row numbers, in one of two sizes), scattered into an allow-all mask on the device: a
batch of 2,048 rows with a vocabulary of 128,256 would otherwise allocate and copy 32 MB
every constrained step however few rows are constrained (a draining batch's few).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from nanojax.errors import NanojaxError

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from llguidance._lib import JsonCompileOptions

# llguidance's JSON compiler: no free whitespace between tokens (a small model otherwise
# can pad a JSON value with newlines until max_tokens)
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
MAX_CACHED_GRAMMARS = 256


class GrammarMasks(NamedTuple):
    """A step's grammar masks (a pytree the sampler takes): mask [N, ceil(V/32)] int32,
    bit j of word w allows token 32w + j, for the rows rows [N] int32; rows past the batch
    (padding) are dropped, and every row not named allows every token."""
    mask: np.ndarray
    rows: np.ndarray


def mask_sizes(num_rows: int) -> tuple[int, ...]:
    """The row counts a step's GrammarMasks comes in (each a sampler shape, compiled at
    warm-up): an eighth of the batch's rows, and all of them."""
    return tuple(sorted({max(1, num_rows // 8), num_rows}))


def mask_rows(constrained: int, num_rows: int) -> int:
    """Rows a step's GrammarMasks holds for this many constrained rows: the smallest of
    mask_sizes that fits."""
    return next(n for n in mask_sizes(num_rows) if constrained <= n)


class StructuredOutputError(NanojaxError, ValueError):
    """A constraint that is malformed or does not compile."""


@dataclasses.dataclass
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's StructuredOutputsParams): json (a JSON schema, as a
    dict or its text), json_object (any JSON object), regex, choice (one of the strings)
    or grammar (Lark, or GBNF as llama.cpp writes it)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # a reasoning model's thinking comes first, free, up to this tag; the constraint
    # applies to what follows it (vLLM's structured outputs with a reasoning parser)
    think_end: str | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise StructuredOutputError("give exactly one structured output constraint of "
                                        f"json, json_object, regex, choice, grammar; got "
                                        f"{given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise StructuredOutputError(f"json: the schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise StructuredOutputError("json: a JSON schema must be an object")
        for field in ("regex", "grammar"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                raise StructuredOutputError(f"{field} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise StructuredOutputError("choice must be a non-empty list of strings")

    def grammar_text(self) -> str:
        """The constraint as llguidance grammar text (the compiled-grammar cache's key);
        StructuredOutputError for anything llguidance or the JSON encoder cannot take (a
        lone surrogate, NaN in a schema, nesting past Python's recursion limit)."""
        try:
            text = self._grammar_text()
            return after_thinking(text, self.think_end) if self.think_end else text
        except StructuredOutputError:
            raise
        except (ValueError, RecursionError) as e:  # UnicodeEncodeError is a ValueError
            field = next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                         if getattr(self, k) not in (None, False))
            raise StructuredOutputError(f"{field}: {_first_line(str(e)) or type(e).__name__}"
                                        ) from None

    def _grammar_text(self) -> str:
        from llguidance import LLMatcher, grammar_from
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      overrides=JSON_OPTIONS)
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(json.dumps(self.json),
                                                      overrides=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None  # one field is set (__post_init__): this one
        try:
            return grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to it
        except ValueError as e:
            raise StructuredOutputError(f"grammar: {e}") from None


def after_thinking(grammar: str, end: str) -> str:
    """A grammar (llguidance's text: a JSON list of grammars, or Lark) preceded by free text
    up to and including `end`: the thinking of a model whose chat template opened the think
    block, which the grammar then does not constrain."""
    try:
        top = json.loads(grammar)
        grammars = list(top["grammars"])
    except (ValueError, KeyError, TypeError):
        top, grammars = {}, [{"lark_grammar": grammar}]
    first = dict(grammars[0])
    first["name"] = name = first.get("name") or "answer"
    thinking = f"start: thinking @{name}\nthinking[stop={json.dumps(end)}]: /(.|\\n)*/\n"
    return json.dumps({**top, "grammars": [{"lark_grammar": thinking}, first, *grammars[1:]]})


class GrammarCompiler:
    """Compiles constraints for one tokenizer. A compiled grammar is cached by its text as
    a matcher that never advances; each request gets a deep copy of it (llguidance's way
    to reuse a compiled grammar). Thread-safe: the server checks constraints on its own
    threads, the engine creates matchers on its."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, max_cached: int = MAX_CACHED_GRAMMARS):
        import llguidance
        self._llg = llguidance
        # the model's vocabulary may be padded past the tokenizer's: masks are its width
        self.vocab_size = vocab_size
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                                    n_vocab=vocab_size,
                                                    eos_token=list(eos_ids) or None)
        except Exception as e:  # llguidance raises plain exceptions for what it cannot read
            raise StructuredOutputError(f"this model's tokenizer cannot drive a grammar: "
                                        f"{e}") from None
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor(num_threads=mask_threads())

    def _compiled(self, spec: StructuredOutputsParams):
        text = spec.grammar_text()
        with self._lock:
            m = self._cache.get(text)
            if m is not None:
                self._cache.move_to_end(text)
                return m
        m = self._llg.LLMatcher(self.tokenizer, text, log_level=0)  # drops the GIL
        if m.is_error():
            raise StructuredOutputError(_first_line(m.get_error()))
        with self._lock:
            self._cache[text] = m
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return m

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raises StructuredOutputError naming what does not compile."""
        self._compiled(spec)

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher for one request."""
        return self._compiled(spec).deep_copy()

    def bitmask(self, rows: list[tuple[LLMatcher, int]], num_rows: int,
                fixed: list[tuple[np.ndarray, int]] | None = None,
                bans: list[tuple[np.ndarray, int]] | None = None) -> GrammarMasks:
        """The masks of a step of num_rows rows. rows: (matcher, row) of its constrained
        rows; fixed: (packed mask, row) of rows with a fixed set of tokens (token_mask),
        ANDed with a matcher's on the same row; bans: (packed mask, row) of tokens a row
        must avoid (bad words: without_tokens), ANDed last where they leave it a token;
        every other row allows every token."""
        from llguidance.numpy import fill_next_token_bitmask_par
        fixed, bans = fixed or [], bans or []
        mask, index = _empty_masks(len({r for _, r in rows} | {r for _, r in fixed}
                                       | {r for _, r in bans}), num_rows, self.vocab_size)
        if rows:
            fill_next_token_bitmask_par(self._executor,
                                        [(m, i) for i, (m, _) in enumerate(rows)], mask)
            index[:len(rows)] = [r for _, r in rows]
            # a matcher in its error state allows nothing; its request ends with an error
            # when the token is read, and an all -inf row must never reach the sampler
            filled = mask[:len(rows)]
            filled[~filled.any(axis=1)] = -1
        _and_bans(mask, index, _and_fixed(mask, index, len(rows), fixed), bans)
        return GrammarMasks(mask, index)


def token_mask(token_ids, vocab_size: int) -> np.ndarray:
    """A packed mask [ceil(V/32)] int32 allowing exactly token_ids (GrammarMasks' bits)."""
    bits = np.zeros(-(-vocab_size // 32) * 32, bool)
    bits[np.asarray(list(token_ids), np.int64)] = True
    return np.packbits(bits.reshape(-1, 4, 8)[:, ::-1, ::-1]).view(">i4").astype(np.int32)


def without_tokens(token_ids, vocab_size: int) -> np.ndarray:
    """A packed mask [ceil(V/32)] int32 allowing every token but token_ids."""
    words = np.full(-(-vocab_size // 32), 0xFFFFFFFF, np.uint32)
    if vocab_size % 32:  # no bits past the vocabulary (token_mask has none either)
        words[-1] = (1 << (vocab_size % 32)) - 1
    ids = np.asarray(list(token_ids), np.int64)
    np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


def bad_words_token_ids(tokenizer, words: list[str], vocab_size: int
                        ) -> list[tuple[int, ...]]:
    """vLLM's reading of bad_words: each word as it tokenizes at the start of a text and,
    where a leading space gives another first token but as many tokens, as it tokenizes
    inside one. Raises ValueError for a word with a token past the model's vocabulary."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        forms = [alone]
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            forms.append(spaced)
        for ids in forms:
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"bad word {word[:40]!r} has token {max(ids)}, outside the "
                                 f"vocabulary [0, {vocab_size})")
            if ids and ids not in out:
                out.append(ids)
    return out


def banned_tokens(bad_ids: list[tuple[int, ...]], output_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word next: each word's last token, where the
    output so far ends with the rest of it (a one-token word: always)."""
    n, banned = len(output_ids), []
    for ids in bad_ids:
        k = len(ids) - 1
        if k <= n and (k == 0 or tuple(output_ids[n - k:]) == ids[:-1]):
            banned.append(ids[-1])
    return banned


def fixed_bitmask(fixed: list[tuple[np.ndarray, int]], num_rows: int, vocab_size: int,
                  bans: list[tuple[np.ndarray, int]] | None = None) -> GrammarMasks:
    """GrammarCompiler.bitmask without matchers (no tokenizer needed)."""
    bans = bans or []
    mask, index = _empty_masks(len({r for _, r in fixed} | {r for _, r in bans}),
                               num_rows, vocab_size)
    _and_bans(mask, index, _and_fixed(mask, index, 0, fixed), bans)
    return GrammarMasks(mask, index)


def _empty_masks(constrained: int, num_rows: int, vocab_size: int):
    size = mask_rows(constrained, num_rows)
    # all bits set; padding rows index past the batch (dropped)
    return (np.full((size, -(-vocab_size // 32)), -1, np.int32),
            np.full(size, num_rows, np.int32))


def _and_fixed(mask, index, used: int, fixed, keep_a_token: bool = False) -> int:
    """Fixed masks into the step's: ANDed into their row's where it has one, else in a
    new row after the used ones; returns the rows used. keep_a_token: a mask that would
    leave its row no token is not applied (an all -inf row must never reach the
    sampler)."""
    where = {int(r): i for i, r in enumerate(index[:used])}
    for m, r in fixed:
        i = where.get(r)
        if i is None and keep_a_token and not m.any():
            continue
        if i is None:
            i = where[r] = used
            index[i] = r
            used += 1
            mask[i] = m
        else:
            both = mask[i] & m
            if not keep_a_token or both.any():
                mask[i] = both
    return used


def _and_bans(mask, index, used: int, bans) -> int:
    """A row's banned tokens (bad words) go last: where a grammar or allowed_token_ids
    leave the row only banned tokens, the ban yields (vLLM would sample from all -inf)."""
    return _and_fixed(mask, index, used, bans, keep_a_token=True)


def mask_threads() -> int:
    """Threads filling a step's masks: a GPU host's spare cores (a large batch's masks
    are slow to fill on one: bench/results/log/structured.md) while the engine thread and
    XLA's keep theirs; at least 2."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def _first_line(message: str) -> str:
    """llguidance's multi-line message on one line, bounded (it quotes the client's text)."""
    return " ".join(message.split())[:500] or "the grammar does not compile"
