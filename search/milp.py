"""Stage I of NanoFlow's search as a MILP: nano-batch sizes and nano-op order.

Given interference-free op times by batch size (multiples of a granularity g), choose K
nano-batches (sizes are decision variables, multiples of g summing to B_dense) and start
times for every nano-op so the layer's makespan is smallest, where
  * a nano-op starts after its nano-batch's previous op finishes (qkv -> attention ->
    o_proj -> mlp; all groups share the split, so ranges intersect only within a batch),
  * two nano-ops bound by the same resource (compute, memory, network) never overlap
    (no two overlap where the profile found that nothing runs together: Profile.concurrent).
K grows from 2 while the compute resource still idles inside the makespan and the
makespan improves. Solved with HiGHS (highspy), or scipy.optimize.milp as a fallback.
Stage II (resource shares with the interference table) is in search/shares.py.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from nanojax.errors import NanojaxError
from nanojax.pipeline.plan import NETWORK_GROUPS, PLAN_VERSION, groups_of, validate


class SearchError(NanojaxError):
    pass


# A measured pair whose attention ran under the GEMM for less than this share of its time
# did not run together (the H200 trace of a serialized pair shows 0.0)
MIN_OVERLAP = 0.05


@dataclasses.dataclass
class Profile:
    b_dense: int
    granularity: int
    resource: dict[str, str]                   # op group -> compute | memory | network
    times: dict[str, dict[int, float]]         # op group -> {tokens: seconds}
    model: dict | None = None
    # op group -> {share: {tokens: seconds}}, interference-free, for ops with a share knob
    share_times: dict[str, dict[float, dict[int, float]]] = dataclasses.field(
        default_factory=dict)
    # share R of the memory op -> (P of the GEMM beside it, P of the memory op)
    interference: dict[float, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # ops whose times[n] is the time of the dense batch's first n tokens (decodes first,
    # then prefill): a nano-batch [a, b) takes times[b] - times[a], so where it sits matters
    prefix: frozenset = frozenset()
    # False when the profiler's pair (a GEMM beside attention, one scheduling group) never
    # ran together on this device and software: then nothing overlaps, every nano-op
    # waits for the one before it, and the search models exactly that
    concurrent: bool = True
    # share of the GPU a network op's kernels occupy while they run (NCCL's SMs), for
    # stage II; the op's time does not depend on it
    network_share: float = 0.1

    @property
    def groups(self) -> tuple[str, ...]:
        """The op groups in data order (with the network ops under TP)."""
        return groups_of(self.times)

    def span_time(self, group: str, a: int, b: int, share: float = 1.0) -> float:
        """Seconds of `group` on the dense batch's tokens [a, b) at resource share."""
        table = self.times[group]
        if share < 1.0 and share in self.share_times.get(group, {}):
            table = self.share_times[group][share]
        if group in self.prefix:
            return table[b] - (table[a] if a else 0.0)
        return table[b - a]

    @classmethod
    def load(cls, path) -> "Profile":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SearchError(f"cannot read profile {path}: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        try:
            b, g = int(d["b_dense"]), int(d["granularity"])
            ops = d["ops"]
            groups = groups_of(ops)
            resource = {k: ops[k]["resource"] for k in groups}
            times = {k: {int(n): float(t) for n, t in ops[k]["times"].items()}
                     for k in groups}
            net_share = float(next((ops[k].get("share", 0.1) for k in NETWORK_GROUPS
                                    if k in ops), 0.1))
        except (KeyError, TypeError, ValueError) as e:
            raise SearchError(f"malformed profile: missing or bad field {e}") from None
        try:
            share_times = {k: {float(r): {int(n): float(t) for n, t in ts.items()}
                               for r, ts in ops[k]["times_by_share"].items()}
                           for k in groups if "times_by_share" in ops[k]}
            table = d.get("interference") or {}
            interference = ({float(r["share"]): (float(r["compute"]), float(r["memory"]))
                             for r in table["rows"]} if table.get("measured") else {})
            concurrent = not (table.get("measured") and table["rows"] and all(
                not r.get("schedule", {}).get("issued_together", True)
                or r.get("attention_overlapped_by_gemm", 1.0) < MIN_OVERLAP
                for r in table["rows"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SearchError(f"malformed profile: bad share or interference data {e}") from None
        if b % g:
            raise SearchError(f"b_dense {b} is not a multiple of the granularity {g}")
        for k in groups:
            need = set(range(g, b + 1, g))
            if not need <= set(times[k]):
                raise SearchError(f"profile of '{k}' lacks sizes {sorted(need - set(times[k]))[:5]}")
            if resource[k] not in ("compute", "memory", "network"):
                raise SearchError(f"'{k}' has unknown resource {resource[k]!r}")
        for k, by_share in share_times.items():
            for r, ts in by_share.items():
                if not 0 < r <= 1 or not set(range(g, b + 1, g)) <= set(ts):
                    raise SearchError(f"profile of '{k}' at share {r} is out of range or "
                                      "lacks sizes")
        prefix = frozenset(k for k in groups if ops[k].get("position") == "prefix")
        for k in prefix:  # more tokens never take less time: clamp timing noise, or a
            times[k] = _running_max(times[k])  # nano-batch's span could cost < 0
            for r in share_times.get(k, {}):
                share_times[k][r] = _running_max(share_times[k][r])
        if not concurrent:  # the table's P values are then times of kernels run apart
            interference = {}
        return cls(b, g, resource, times, d.get("model"), share_times, interference, prefix,
                   concurrent, net_share)


def _running_max(table: dict[int, float]) -> dict[int, float]:
    out, top = {}, float("-inf")
    for n in sorted(table):
        top = max(top, table[n])
        out[n] = top
    return out


class _Milp:
    """A tiny modelling layer: variables, rows, objective -> HiGHS or scipy."""

    def __init__(self):
        self.lb, self.ub, self.integer, self.cost = [], [], [], []
        self.rows: list[tuple[dict, float, float]] = []

    def var(self, lb=0.0, ub=np.inf, integer=False, cost=0.0) -> int:
        self.lb.append(lb), self.ub.append(ub), self.integer.append(integer)
        self.cost.append(cost)
        return len(self.lb) - 1

    def row(self, coeffs: dict, lo=-np.inf, hi=np.inf) -> None:
        self.rows.append((coeffs, lo, hi))

    def solve(self, time_limit: float) -> np.ndarray:
        from scipy.sparse import csc_matrix
        n, m = len(self.lb), len(self.rows)
        r, c, v = [], [], []
        for i, (coeffs, _, _) in enumerate(self.rows):
            for j, a in coeffs.items():
                r.append(i), c.append(j), v.append(a)
        a = csc_matrix((v, (r, c)), shape=(m, n))
        lo = np.array([x[1] for x in self.rows])
        hi = np.array([x[2] for x in self.rows])
        try:
            import highspy
        except ImportError:
            highspy = None
        if highspy is not None:
            h = highspy.Highs()
            h.setOptionValue("output_flag", False)
            h.setOptionValue("time_limit", float(time_limit))
            h.setOptionValue("random_seed", 0)
            h.setOptionValue("threads", 1)  # same input, same plan
            lp = highspy.HighsLp()
            lp.num_col_, lp.num_row_ = n, m
            lp.col_cost_ = np.array(self.cost)
            lp.col_lower_, lp.col_upper_ = np.array(self.lb), np.array(self.ub)
            lp.row_lower_, lp.row_upper_ = lo, hi
            lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
            lp.a_matrix_.start_ = a.indptr
            lp.a_matrix_.index_ = a.indices
            lp.a_matrix_.value_ = a.data
            lp.integrality_ = [highspy.HighsVarType.kInteger if i
                               else highspy.HighsVarType.kContinuous for i in self.integer]
            h.passModel(lp)
            h.run()
            status = h.getModelStatus()
            if status == highspy.HighsModelStatus.kOptimal:
                return np.array(h.getSolution().col_value)
            if status == highspy.HighsModelStatus.kInfeasible:
                raise SearchError("the search problem is infeasible")
            if status == highspy.HighsModelStatus.kTimeLimit and h.getInfo().primal_solution_status == 2:
                return np.array(h.getSolution().col_value)
            raise SearchError(f"HiGHS stopped without a solution: {h.modelStatusToString(status)}")
        from scipy.optimize import Bounds, LinearConstraint, milp
        res = milp(np.array(self.cost), integrality=np.array(self.integer, int),
                   bounds=Bounds(self.lb, self.ub), constraints=LinearConstraint(a, lo, hi),
                   options={"time_limit": time_limit})
        if res.x is None:
            raise SearchError(f"scipy milp found no solution: {res.message}")
        return res.x


def stage1(profile: Profile, k: int, time_limit: float = 60.0) -> dict:
    """Best schedule with exactly k nano-batches."""
    g, units = profile.granularity, profile.b_dense // profile.granularity
    if not 1 <= k <= units:
        raise SearchError(f"cannot cut {profile.b_dense} tokens into {k} nano-batches of "
                          f"multiples of {g}")
    sizes = range(1, units - k + 2)
    groups = profile.groups
    m = _Milp()
    x = {(b, s): m.var(0, 1, True) for b in range(k) for s in sizes}
    start = {(j, b): m.var() for j in groups for b in range(k)}
    dur = {(j, b): m.var() for j in groups for b in range(k)}
    cmax = m.var(cost=1.0)
    big = sum(max(abs(t) for t in profile.times[j].values()) for j in groups) * k * 2
    # where nano-batch b ends (in units): only needed when some op's time depends on it
    ends = range(1, units + 1)
    e = ({(b, u): m.var(0, 1, True) for b in range(k) for u in ends}
         if profile.prefix else {})
    for b in range(k):
        m.row({x[b, s]: 1 for s in sizes}, 1, 1)
        if e:
            m.row({e[b, u]: 1 for u in ends}, 1, 1)
            link = {e[b, u]: u for u in ends}  # end_b - end_{b-1} = size_b
            for u in ends:
                if b:
                    link[e[b - 1, u]] = link.get(e[b - 1, u], 0) - u
            for sz in sizes:
                link[x[b, sz]] = link.get(x[b, sz], 0) - sz
            m.row(link, 0, 0)
        for j in groups:
            if j in profile.prefix:  # times[end_b] - times[end_{b-1}]
                coeffs = {e[b, u]: -profile.times[j][u * g] for u in ends}
                if b:
                    for u in ends:
                        coeffs[e[b - 1, u]] = profile.times[j][u * g]
            else:
                coeffs = {x[b, s]: -profile.times[j][s * g] for s in sizes}
            coeffs[dur[j, b]] = 1
            m.row(coeffs, 0, 0)
        for prev, nxt in zip(groups, groups[1:]):
            m.row({start[nxt, b]: 1, start[prev, b]: -1, dur[prev, b]: -1}, 0)
        m.row({cmax: 1, start[groups[-1], b]: -1, dur[groups[-1], b]: -1}, 0)
    m.row({x[b, s]: s for b in range(k) for s in sizes}, units, units)
    symmetric = not profile.prefix
    for b in range(k - 1 if symmetric else 0):
        # op times depend on sizes only, so nano-batches are interchangeable: ordering
        # their attention loses nothing and breaks the symmetry between them
        a0, a1 = ("attention", b), ("attention", b + 1)
        m.row({start[a1]: 1, start[a0]: -1, dur[a0]: -1}, 0)
    nano = [(j, b) for j in groups for b in range(k)]
    for i, a in enumerate(nano):
        for c in nano[i + 1:]:
            if a[1] == c[1] or (profile.concurrent
                                and profile.resource[a[0]] != profile.resource[c[0]]):
                continue  # same batch: already ordered by the chain
            if symmetric and a[0] == c[0] == "attention":
                continue  # ordered above
            y = m.var(0, 1, True)
            m.row({start[a]: 1, dur[a]: 1, start[c]: -1, y: big}, hi=big)
            m.row({start[c]: 1, dur[c]: 1, start[a]: -1, y: -big}, hi=0)
    sol = m.solve(time_limit)
    size = [g * next(s for s in sizes if sol[x[b, s]] > 0.5) for b in range(k)]
    starts = {op: float(sol[start[op]]) for op in nano}
    durs = {op: float(sol[dur[op]]) for op in nano}
    return {"k": k, "sizes": size, "makespan": float(sol[cmax]), "start": starts,
            "duration": durs}


def compute_idle(profile: Profile, sched: dict) -> float:
    busy = sum(d for (j, _), d in sched["duration"].items()
               if profile.resource[j] == "compute")
    return sched["makespan"] - busy


def search(profile: Profile, max_k: int = 4, time_limit: float = 120.0, progress=None):
    best = None
    for k in range(1, max_k + 1):
        if k > profile.b_dense // profile.granularity:
            break
        s = stage1(profile, k, time_limit)
        if progress is not None:
            progress(k, s)
        if best is not None and s["makespan"] >= best["makespan"] * (1 - 1e-9):
            break
        best = s
        if k >= 2 and compute_idle(profile, s) <= 1e-9 * s["makespan"]:
            break  # no compute bubble left
    return best


def to_plan(profile: Profile, sched: dict, model_signature: dict, tp: int = 1) -> dict:
    bounds, pos = [], 0
    for s in sched["sizes"]:
        bounds.append([pos, pos + s])
        pos += s
    groups = profile.groups
    order = sorted(sched["start"], key=lambda op: (sched["start"][op],
                                                    groups.index(op[0])))
    stream = {"compute": 0, "memory": 1, "network": 3}
    start, dur = sched["start"], sched["duration"]

    def stream_of(op):
        """A GEMM that runs beside a memory op goes on stream 2: only side-stream regions
        can join that op's XLA scheduling group (executor.overlap_groups). Network ops go
        on stream 3 (XLA's async collectives; a GEMM beside one needs no side stream)."""
        kind = profile.resource[op[0]]
        if not profile.concurrent or len(sched["sizes"]) == 1:
            return 0  # nothing runs beside it: a side stream would only add a sync
        if kind != "compute":
            return stream[kind]
        beside = any(profile.resource[o[0]] == "memory"
                     and start[o] < start[op] + dur[op] and start[op] < start[o] + dur[o]
                     for o in start)
        return 2 if beside else 0
    plan = {"version": PLAN_VERSION, "name": "searched", "model": model_signature, "tp": tp,
            "b_dense": profile.b_dense, "granularity": profile.granularity,
            "nano_batches": {j: [list(b) for b in bounds] for j in groups},
            "nano_ops": [{"op": j, "batch": b, "stream": stream_of((j, b)),
                          "share": sched.get("share", {}).get((j, b), 1.0)}
                         for j, b in order],
            "predicted": {"makespan_s": sched["makespan"],
                          "start_s": {f"{j}[{b}]": t for (j, b), t in sched["start"].items()},
                          "duration_s": {f"{j}[{b}]": t for (j, b), t in
                                         sched["duration"].items()}}}
    return validate(plan)
