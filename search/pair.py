"""The interference table from a measured GEMM + attention pair (issue 18), and the plan's
fused pairs where that pair pays (`fuse`).

nanojax/profiling/fused_pair.py (`nanojax profile --pair-shares`, bench/kernels/
fused_pair.py) times, at a nano-batch's shapes, one launch whose programs
[0, G) run a GEMM and programs [G, N) decode attention, against each side alone on its
programs and against the two back to back on the full grid. That is the pair the executor
would run, so it is the interference stage II should read (search/shares.py), in place of
the profiler's two-stream pair, which on the H200 never ran together.

For a GEMM share G / N (attention share R = 1 - G / N), the pair took `pair` where the
sides alone took `gemm_g` and `attention_g`; each side is charged the pair's slowdown
s = pair / max(gemm_g, attention_g) (one launch: both sides end by `pair`, the slower
one is what the measurement sees). In stage II's terms (performance relative to the op
alone): the GEMM at share 1 - R runs at P_c = gemm_full / (gemm_g * s), the attention at
share R at P_m = 1 / s against its own time at R. Rows are averaged over the GEMMs the
file holds, then interpolated to the profile's attention shares (linear in R, clamped at
the measured ends: a share outside them is never assumed to run free).
"""
from __future__ import annotations

import numpy as np

SOURCE = "fused GEMM + attention launch (nanojax/profiling/fused_pair.py)"
FUSED_IMPL = "nanojax fused launch"  # the impl of nanojax's own records
# the fused launch's relative error against XLA's GEMM and the swap-AB kernel, above
# which its times are not read (bf16 outputs of a right kernel: ~1e-3)
REL_ERROR_LIMIT = 2e-2


def checked_gemms(record: dict) -> dict:
    """The GEMM entries whose times may be read: every entry of a reference file (PyTorch's
    green-context pair); of nanojax's fused launch only those whose launch passed its
    correctness check, so a wrong kernel, or a run cut short before the check ("partial"),
    cannot pass as a fast one."""
    gemms = record.get("gemms", {})
    if record.get("impl") != FUSED_IMPL:
        return gemms
    inf = float("inf")
    return {name: g for name, g in gemms.items()
            if "error" not in (err := g.get("fused_rel_error") or {"error": "unchecked"})
            and max(err.get("gemm", inf), err.get("attention_vs_swapab", inf))
            < REL_ERROR_LIMIT}


def pair_rows(record: dict) -> list[dict]:
    """Per GEMM share: attention share R, P of the GEMM and of the attention, and the
    pair's gain over back to back (mean over the GEMMs measured at that share)."""
    n = int(record["programs"])
    by_share: dict[float, list[tuple]] = {}
    for gemm in checked_gemms(record).values():
        # the profile's GEMM times are XLA's: P_c is relative to them (the PyTorch
        # reference file names its full-grid GEMM gemm_full)
        full = gemm.get("xla_gemm") or gemm.get("gemm_full") or gemm.get("gemm_part_full")
        b2b = gemm.get("back_to_back")
        for row in gemm.get("shares", []):
            if "error" in row or full is None or b2b is None:
                continue
            g_ms, a_ms, p_ms = (row[k]["ms"] for k in ("gemm", "attention", "pair"))
            s = max(1.0, p_ms / max(g_ms, a_ms))
            r = round(1 - int(row.get("gemm_sms", row["G"])) / n, 6)
            power = (row["pair"].get("power") or {})
            by_share.setdefault(r, []).append(
                (full["ms"] / (g_ms * s), 1.0 / s, b2b["ms"] / p_ms,
                 power.get("power_w_mean"), power.get("sm_clock_mhz_mean")))

    def mean(vals, i):  # the pair's power and clock: where nvidia-smi sampled them
        got = [v[i] for v in vals if v[i] is not None]
        return float(np.mean(got)) if got else None
    return [{"share": r, "compute": mean(vals, 0), "memory": mean(vals, 1),
             "gain_over_back_to_back": mean(vals, 2), "pair_power_w": mean(vals, 3),
             "pair_sm_clock_mhz": mean(vals, 4), "gemms": len(vals)}
            for r, vals in sorted(by_share.items())]


def best_gain(record: dict) -> float | None:
    """The pair's best gain over back to back, over every GEMM and share it measured."""
    gains = [g["back_to_back"]["ms"] / row["pair"]["ms"]
             for g in checked_gemms(record).values() if "back_to_back" in g
             for row in g.get("shares", []) if "error" not in row]
    return max(gains, default=None)


def interference_from_pair(record: dict, shares) -> dict:
    """The profile's `interference` table at these attention shares (below 1), from a
    fused-pair record; `best_gain` is the pair's best gain over back to back."""
    rows = pair_rows(record)
    if not rows:
        return {"measured": False, "source": SOURCE, "reason": "the pair file has no rows"}
    rs = np.array([r["share"] for r in rows])
    out = []
    for r in sorted(s for s in shares if 0 < s < 1):
        out.append({"share": r,
                    **{k: float(np.interp(r, rs, [x[k] for x in rows]))
                       for k in ("compute", "memory", "gain_over_back_to_back")},
                    # one launch: the two sides always run together
                    "schedule": {"issued_together": True},
                    "attention_overlapped_by_gemm": 1.0})
    return {"measured": True, "source": SOURCE, "measured_shares": rows, "rows": out,
            "best_gain": best_gain(record),
            "device": record.get("device"), "command": record.get("command")}


def best_programs(record: dict) -> int | None:
    """The GEMM share G (of the record's programs) with the best mean gain over back to
    back across the GEMMs measured (None: no share measured)."""
    n = int(record["programs"])
    rows = pair_rows(record)
    if not rows:
        return None
    r = max(rows, key=lambda x: x["gain_over_back_to_back"])["share"]
    return min(n - 1, max(1, round((1 - r) * n)))


def _adjacent(nano_batches: dict, ops: list, i: int, j: int):
    """ops with the later of positions i, j moved right after the earlier one, or else the
    earlier moved right before the later; None when neither keeps every op after its
    inputs."""
    from nanojax.pipeline.plan import PlanError, check_order
    lo, hi = sorted((i, j))
    for moved in (ops[:lo + 1] + [ops[hi]] + ops[lo + 1:hi] + ops[hi + 1:],
                  ops[:lo] + ops[lo + 1:hi] + [ops[lo], ops[hi]] + ops[hi + 1:]):
        try:
            check_order({"nano_batches": nano_batches, "nano_ops": moved})
            return moved
        except PlanError:
            continue
    return None


def fuse(plan: dict, sched: dict, record: dict) -> tuple[dict, list[dict]]:
    """The plan with each attention nano-op that the schedule runs beside a GEMM nano-op
    fused with the GEMM it overlaps most (one launch, plan.py's "fused"), its G from
    stage II's attention share R (G = (1 - R) x programs) or, at R = 1, the pair's best
    measured G; the two moved next to each other and onto stream 0. Returns (plan, one
    entry per attention nano-op beside a GEMM: the pair, or why it was not fused)."""
    import copy

    from nanojax.pipeline.plan import GEMM_GROUPS, PlanError, validate
    plan = copy.deepcopy(plan)
    n = int(record["programs"])
    start, dur = sched["start"], sched["duration"]
    share = sched.get("share", {})
    best_g = best_programs(record)
    taken, out = set(), []

    def overlap(a, b):
        return max(0.0, min(start[a] + dur[a], start[b] + dur[b]) - max(start[a], start[b]))

    for att in sorted((o for o in start if o[0] == "attention"), key=lambda o: start[o]):
        beside = sorted(((overlap(att, o), o) for o in start
                         if o[0] in GEMM_GROUPS and o not in taken and overlap(att, o) > 0),
                        reverse=True)
        if not beside:
            continue
        r = float(share.get(att, 1.0))
        g = min(n - 1, max(1, round((1 - r) * n))) if r < 1 else best_g
        entry = {"attention": att[1], "gemm_programs": g, "programs": n,
                 "g_from": "stage II share" if r < 1 else "best measured G"}
        if g is None:
            out.append({**entry, "not_fused": "the pair record has no measured share"})
            continue
        why = []
        for _, gemm in beside:  # the most overlapped GEMM first; the next if it cannot
            ops = plan["nano_ops"]
            idx = {(op["op"], op["batch"]): i for i, op in enumerate(ops)}
            moved = _adjacent(plan["nano_batches"], ops, idx[gemm], idx[att])
            if moved is None:
                why.append(f"{gemm[0]}[{gemm[1]}]: cannot be made adjacent")
                continue
            trial = copy.deepcopy({**plan, "nano_ops": moved})
            for op in trial["nano_ops"]:
                if (op["op"], op["batch"]) in (gemm, att):
                    op.update(stream=0, share=1.0)
                if (op["op"], op["batch"]) == gemm:
                    op["fused"] = {"attention": att[1], "gemm_programs": g, "programs": n}
            try:
                plan = validate(trial)
            except PlanError as e:
                why.append(f"{gemm[0]}[{gemm[1]}]: {e}")
                continue
            taken.add(gemm)
            entry["gemm"] = f"{gemm[0]}[{gemm[1]}]"
            break
        else:
            entry["not_fused"] = "; ".join(why)
        out.append(entry)
    if not any(op.get("stream") == 1 for op in plan["nano_ops"]):
        for op in plan["nano_ops"]:  # no side-stream attention left to run beside
            if op.get("stream") == 2:
                op["stream"] = 0
    return validate(plan), out
