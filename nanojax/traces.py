"""Request-length traces: (prompt, output) token counts of real serving workloads.

`nanojax/data/traces.json` ships 4,000 sampled pairs of each of NanoFlow's traces
(splitwise, lmsys, sharegpt); any Azure-format CSV (TIMESTAMP,ContextTokens,
GeneratedTokens) works too.
"""
from __future__ import annotations

import csv
import json
from importlib import resources
from pathlib import Path

from nanojax.errors import NanojaxError

TRACES = ("splitwise", "lmsys", "sharegpt")


def trace_lengths(trace: str) -> list[tuple[int, int]]:
    """(prompt, output) lengths: a shipped trace name or an Azure-format CSV path."""
    if trace in TRACES:
        data = json.loads(resources.files("nanojax.data").joinpath("traces.json").read_text())
        return [tuple(r) for r in data["traces"][trace]]
    path = Path(trace)
    if not path.is_file():
        raise NanojaxError(f"unknown trace {trace!r}: not one of {TRACES} and not a file")
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            try:
                rows.append((int(float(row["ContextTokens"])), int(float(row["GeneratedTokens"]))))
            except (KeyError, ValueError):
                raise NanojaxError(f"{path} is not a TIMESTAMP,ContextTokens,GeneratedTokens "
                                   "trace") from None
    return rows
