"""A model directory's generation_config.json (transformers' file): the stop tokens and the
default sampling parameters its authors ship (Qwen3: temperature 0.6, top_p 0.95, top_k
20; eos [<|im_end|>, <|endoftext|>]). vLLM applies those defaults to requests that leave
the fields unset (`--generation-config auto`, its default); nanojax's server and LLM do
the same (ModelBundle.sampling_defaults). A nanojax checkpoint keeps the file."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from nanojax.errors import CheckpointError

FILE = "generation_config.json"
# the fields taken as sampling defaults: (lowest, highest, lowest excluded), the range a
# request may give them in (nanojax/server/protocol.py)
SAMPLING_FIELDS = {"temperature": (0.0, 2.0, False), "top_p": (0.0, 1.0, True),
                   "top_k": (1, 1 << 30, False), "min_p": (0.0, 1.0, False),
                   "repetition_penalty": (0.0, 10.0, True),
                   "max_new_tokens": (1, (1 << 31) - 1, False)}
# transformers' own defaults: a file that states them changes nothing (vLLM reads the file
# through GenerationConfig.to_diff_dict(), which drops them)
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0,
               "min_p": 0.0}  # (transformers' min_p is None: 0 is off too)
# the request field each one fills
REQUEST_FIELD = {"max_new_tokens": "max_tokens"}


def _usable(key: str, v) -> bool:
    lo, hi, lo_open = SAMPLING_FIELDS[key]
    if key in ("top_k", "max_new_tokens") and not isinstance(v, int):
        return False
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v > lo if lo_open else v >= lo) and v <= hi)


def read_generation_config(path: Path) -> tuple[dict, tuple[int, ...]]:
    """(sampling defaults, stop token ids) from path/generation_config.json; ({}, ()) where
    there is none. The defaults are keyed by request field (max_new_tokens: max_tokens).
    Values a request could not give (out of range, not numbers) are left out, each said on
    stderr; so are transformers' own defaults and top_k 0 (its "no top-k"), which change
    nothing; a corrupt file is a CheckpointError."""
    f = Path(path) / FILE
    if not f.is_file():
        return {}, ()
    try:
        raw = json.loads(f.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"corrupt {f}: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{f} is not a JSON object")
    defaults = {}
    for key in SAMPLING_FIELDS:
        v = raw.get(key)
        if v is None or (key == "top_k" and v == 0) or HF_DEFAULTS.get(key, object()) == v:
            continue
        if _usable(key, v):
            defaults[REQUEST_FIELD.get(key, key)] = v
        else:
            print(f"nanojax: {f}: {key} {str(v)[:40]} is not a usable default; left out",
                  file=sys.stderr)
    eos = raw.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else eos
    if eos is not None and not (isinstance(eos, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in eos)):
        raise CheckpointError(f"{f}: eos_token_id must be a token id or a list of them")
    return defaults, tuple(eos or ())


def write_generation_config(path: Path, defaults: dict) -> None:
    """The sampling defaults as a generation_config.json (nothing when there are none)."""
    if defaults:
        fields = {v: k for k, v in REQUEST_FIELD.items()}
        (Path(path) / FILE).write_text(json.dumps(
            {fields.get(k, k): v for k, v in defaults.items()}, indent=2))
