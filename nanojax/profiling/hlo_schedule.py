"""What XLA actually scheduled: side-stream regions and the main-stream work between their
start and done, read from an optimized HLO dump (`nanojax bench step --dump-hlo DIR`).

A region on stream N > 0 becomes an async start/done pair in the entry computation. The
main stream runs the instructions listed between the two while the region runs; if none
of them is a GEMM, the region's time is not hidden behind compute. The H200 timeline
showed exactly that (no attention under a GEMM: bench/results/log/overlap_search.md); this
reads the cause off the schedule.
"""
from __future__ import annotations

import re
from pathlib import Path

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*)$")
_OPERAND = re.compile(r"%?([\w.\-]+)")
_GEMM_MARKS = ("__cublas$gemm", "__cublas$lt$matmul", "__triton_gemm", "gemm_fusion",
               "triton_gemm", "cutlass_gemm")
_NANO_OP = re.compile(r"nanoop_([a-z_]+?)_b(\d+)")
_COLLECTIVES = ("all-reduce-start", "all-gather-start", "collective-permute-start",
                "reduce-scatter-start", "all-to-all-start")
_NOP = {"get-tuple-element", "tuple", "bitcast", "parameter", "constant", "opt-barrier"}


def entry_instructions(hlo_text: str) -> list[dict]:
    """The entry computation's instructions in schedule order (a scheduled module prints
    them in the order they run): name, opcode, first operand, and whether it is a GEMM."""
    lines = hlo_text.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY"))
    except StopIteration:
        raise ValueError("no ENTRY computation in this HLO text") from None
    out = []
    for ln in lines[start + 1:]:
        if ln.startswith("}"):
            break
        m = _INSTR.match(ln)
        if not m:
            continue
        name, opcode, rest = m.groups()
        first = _OPERAND.match(rest)
        nano = _NANO_OP.search(ln)
        out.append({"name": name, "opcode": opcode,
                    # the executor's nano-op scope (jax.named_scope) in the op's metadata
                    "nano_op": nano.group(1) if nano else None,
                    "nano_batch": int(nano.group(2)) if nano else None,
                    "operand": first.group(1) if first else None,
                    "gemm": opcode == "dot" or any(k in ln for k in _GEMM_MARKS),
                    # a compute region (not a collective) run asynchronously
                    "side": opcode in ("call-start", "async-start") and (
                        "_xla_stream_annotation" in ln or "operation_queue_id" in ln
                        or "async_execution_thread" in ln),
                    "thread": _attr(ln, "async_execution_thread"),
                    "collective": any(c[:-len("-start")] in ln for c in _COLLECTIVES),
                    "stream": _attr(ln, "_xla_stream_annotation"),
                    "group": _attr(ln, "_scheduling_group_id"),
                    "queue": _attr(ln, "operation_queue_id")})
    return out


def _attr(line: str, key: str) -> str | None:
    m = re.search(key + r'"?\s*[:=]\s*"?([\w\-]+)', line)
    return m.group(1) if m else None


def side_regions(instrs: list[dict]) -> list[dict]:
    """Every async start on another execution thread, with the work scheduled before its
    done: how many instructions, how many of them GEMMs, their names."""
    pos = {x["name"]: i for i, x in enumerate(instrs)}
    regions = []
    for i, x in enumerate(instrs):
        if not (x["opcode"].endswith("-start") and x["side"]):
            continue
        done = _done_of(instrs, i)
        if done is None:
            continue
        between = [y for y in instrs[i + 1:done] if y["opcode"] not in _NOP]
        regions.append({"start": x["name"], "position": pos[x["name"]], "done_at": done,
                        "thread": x["thread"], "stream": x["stream"], "queue": x["queue"],
                        "group": x["group"], "done_group": instrs[done]["group"],
                        "ops_between": len(between),
                        "gemms_between": sum(y["gemm"] for y in between),
                        "between": [y["name"] for y in between][:12]})
    return regions


def _done_of(instrs: list[dict], i: int) -> int | None:
    """Position of the -done that closes the async start at position i (None: none)."""
    return next((j for j in range(i + 1, len(instrs))
                 if instrs[j]["opcode"].endswith("-done")
                 and instrs[j]["operand"] == instrs[i]["name"]), None)


def collective_pairs(instrs: list[dict]) -> list[dict]:
    """Every async collective's start/done pair (GPU HLO: all-reduce-start ... -done, or an
    async-start wrapping a collective), with the GEMMs scheduled between them and how many
    of those belong to another nano-batch than the collective's (the overlap the plan's
    network nano-ops are for)."""
    pairs = []
    for i, x in enumerate(instrs):
        wrapped = x["opcode"] == "async-start" and x.get("collective")
        if not (x["opcode"] in _COLLECTIVES or wrapped):
            continue
        done = _done_of(instrs, i)
        if done is None:
            continue
        gemms = [y for y in instrs[i + 1:done] if y["gemm"]]
        other = [y for y in gemms if y["nano_batch"] is not None
                 and x["nano_batch"] is not None and y["nano_batch"] != x["nano_batch"]]
        pairs.append({"start": x["name"], "opcode": x["opcode"], "position": i,
                      "done_at": done, "nano_op": x["nano_op"], "nano_batch": x["nano_batch"],
                      "gemms_between": len(gemms),
                      "other_batch_gemms_between": len(other),
                      "gemms": [f"{y['name']} ({y['nano_op']}[{y['nano_batch']}])"
                                for y in gemms][:12]})
    return pairs


def report(path: str | Path) -> dict:
    """Summary over one HLO text file (or the largest *after_optimizations.txt in a dump
    directory, which is the model step)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size)
        if not files:
            raise ValueError(f"no *after_optimizations.txt under {p}")
        p = files[-1]
    instrs = entry_instructions(p.read_text())
    regions = side_regions(instrs)
    colls = collective_pairs(instrs)
    return {"file": str(p), "instructions": len(instrs),
            "instructions_in_a_group": sum(x["group"] is not None for x in instrs),
            "gemms_in_a_group": sum(x["group"] is not None and x["gemm"] for x in instrs),
            "side_regions": len(regions),
            "regions_with_a_gemm_between": sum(r["gemms_between"] > 0 for r in regions),
            "gemms_between_total": sum(r["gemms_between"] for r in regions),
            "regions": regions,
            "collectives": len(colls),
            "collectives_with_other_batch_gemm_between": sum(
                c["other_batch_gemms_between"] > 0 for c in colls),
            "collective_pairs": colls}
