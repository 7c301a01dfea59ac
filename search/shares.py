"""Stage II of the search as a MILP: a resource share for every nano-op.

Stage I fixed the nano-batches and the order of nano-ops on each resource. Here each
nano-op picks a share R from the profiled levels, which sets its duration:
  * a compute op (GEMM) at share R takes  best time / R;
  * a memory op at share R takes its measured time at R (the decode kernel's program
    count is its share), divided by P(R), its performance beside a GEMM from the
    interference table (P = 1 where the table was not measured).
Two ops of different resources either run apart in time or together, and then their
shares sum to at most 1. With one op per resource at a time this pairwise rule is the
rule "the shares of running ops sum to at most 1" for two resources; with three
(collectives under TP) it is a relaxation. The makespan is minimised.
"""
from __future__ import annotations

import numpy as np

from nanojax.pipeline.plan import producers
from search.milp import Profile, SearchError, _Milp


def _levels(profile: Profile, group: str) -> list[float]:
    if profile.resource[group] == "compute":
        # a GEMM takes what the memory or network ops beside it leave: 1 - R for each
        # of their levels
        mem = {r for g, by in profile.share_times.items() for r in by}
        if any(profile.resource[g] == "network" for g in profile.groups):
            mem.add(profile.network_share)
        return sorted({1.0} | {round(1 - r, 6) for r in mem if r < 1})
    if profile.resource[group] == "network":
        return [profile.network_share]
    return sorted(profile.share_times.get(group, {1.0: None}))


def _duration(profile: Profile, group: str, span: tuple[int, int], r: float) -> float:
    """Seconds of `group` on the tokens span = [a, b) at share r."""
    if profile.resource[group] == "network":  # a collective's time: link-bound
        return profile.span_time(group, *span)
    if profile.resource[group] == "compute":
        if r >= 1:
            return profile.span_time(group, *span)
        measured = profile.interference.get(round(1 - r, 6))
        p = measured[0] if measured else r  # unmeasured: a GEMM's speed scales with R
        return profile.span_time(group, *span) / p
    t = profile.span_time(group, *span, share=r)
    p = profile.interference.get(r, (1.0, 1.0))[1] if r < 1 else 1.0
    return t / p


def stage2(profile: Profile, sched: dict, time_limit: float = 60.0) -> dict:
    """Shares for the nano-ops of a stage-I schedule; returns the schedule with `share`,
    new `start`/`duration` and the predicted `makespan`."""
    ops = sorted(sched["start"], key=lambda o: (sched["start"][o], o))
    producer = producers(profile.groups)
    bounds = np.cumsum([0] + list(sched["sizes"])).tolist()
    size = {o: (bounds[o[1]], bounds[o[1] + 1]) for o in ops}  # token span of each nano-op
    m = _Milp()
    cmax = m.var(cost=1.0)
    horizon = sum(max(_duration(profile, g, size[(g, b)], r) for r in _levels(profile, g))
                  for g, b in ops)
    start, dur, share, z = {}, {}, {}, {}
    for o in ops:
        g, _ = o
        start[o], dur[o], share[o] = m.var(), m.var(), m.var(0, 1)
        levels = _levels(profile, g)
        z[o] = {r: m.var(0, 1, True) for r in levels}
        m.row({v: 1 for v in z[o].values()}, 1, 1)
        m.row({dur[o]: 1, **{z[o][r]: -_duration(profile, g, size[o], r) for r in levels}},
              0, 0)
        m.row({share[o]: 1, **{z[o][r]: -r for r in levels}}, 0, 0)
        m.row({cmax: 1, start[o]: -1, dur[o]: -1}, 0)
    for o in ops:  # after all variables exist: a producer may be sorted after its consumer
        if o[0] in producer:  # data dependency within the nano-batch
            p = (producer[o[0]], o[1])
            m.row({start[o]: 1, start[p]: -1, dur[p]: -1}, 0)
    for res in {profile.resource[g] for g, _ in ops}:  # stage I's order on each resource
        seq = [o for o in ops if profile.resource[o[0]] == res]
        for a, b in zip(seq, seq[1:]):
            m.row({start[b]: 1, start[a]: -1, dur[a]: -1}, 0)
    for i, a in enumerate(ops):
        for b in ops[i + 1:]:
            if profile.resource[a[0]] == profile.resource[b[0]]:
                continue
            ab, ba, both = m.var(0, 1, True), m.var(0, 1, True), m.var(0, 1, True)
            m.row({ab: 1, ba: 1, both: 1}, 1, 1)
            m.row({start[a]: 1, dur[a]: 1, start[b]: -1, ab: horizon}, hi=horizon)
            m.row({start[b]: 1, dur[b]: 1, start[a]: -1, ba: horizon}, hi=horizon)
            m.row({share[a]: 1, share[b]: 1, both: 1}, hi=2)
    sol = m.solve(time_limit)
    out = dict(sched)
    out["share"] = {o: next(r for r, v in z[o].items() if sol[v] > 0.5) for o in ops}
    out["start"] = {o: float(sol[start[o]]) for o in ops}
    out["duration"] = {o: float(sol[dur[o]]) for o in ops}
    out["makespan"] = float(sol[cmax])
    if out["makespan"] > horizon * (1 + 1e-6):
        raise SearchError("stage II found no schedule within its horizon")
    return out
