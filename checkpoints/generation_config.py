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
                   "top_k": (1, 1 << 30, False), "repetition_penalty": (0.0, 10.0, True)}


def _usable(key: str, v) -> bool:
    lo, hi, lo_open = SAMPLING_FIELDS[key]
    if key == "top_k" and not isinstance(v, int):
        return False
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v > lo if lo_open else v >= lo) and v <= hi)


def read_generation_config(path: Path) -> tuple[dict, tuple[int, ...]]:
    """(sampling defaults, stop token ids) from path/generation_config.json; ({}, ()) where
    there is none. Values a request could not give (out of range, not numbers; top_k 0,
    transformers' "no top-k") are left out, each said on stderr; a corrupt file is a
    CheckpointError."""
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
        if v is None or (key == "top_k" and v == 0):
            continue
        if _usable(key, v):
            defaults[key] = v
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
        (Path(path) / FILE).write_text(json.dumps(defaults, indent=2))
