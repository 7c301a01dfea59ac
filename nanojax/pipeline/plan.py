"""The plan: a versioned JSON document, the contract between search/ and the executor.

    {"version": 1,
     "model": {num_layers, hidden_size, num_heads, num_kv_heads, head_dim,
               intermediate_size},          # the signature the plan was made for
     "tp": 1, "b_dense": 2048, "granularity": 128,
     "nano_batches": {"qkv": [[0, 1024], [1024, 2048]], "attention": [...],
                      "o_proj": [...], "mlp": [...]},   # token ranges per op group
     "nano_ops": [{"op": "qkv", "batch": 0, "stream": 0, "share": 1.0}, ...]}
                                            # one layer's nano-ops in issue order

Streams: 0 is the main stream, 1 and 2 side streams, 3 collectives. `share` is the
fraction of the GPU a kernel may take (the decode kernel's persistent program count).

Fused pairs (issue 18): a GEMM nano-op (qkv, o_proj, mlp) may carry
    "fused": {"attention": j, "gemm_programs": G, "programs": N}
meaning it and attention nano-op j run as ONE launch of N programs, programs [0, G) the
GEMM and the rest decode attention (pallas_kernels/fused_gemm_attention_mgpu.py). The two
nano-ops must be adjacent in nano_ops, both on stream 0 (the split is inside the launch,
not across streams), neither reading the other's output, 0 < G < N, and each attention
nano-op in at most one pair. The plan is one layer's nano-ops, applied to every layer, so a
pair never spans layers. Where the fused kernel cannot run (no Hopper GPU, another decode
kernel, shapes it cannot tile), the executor runs the two nano-ops one after the other
and says why (executor.PipelineForward.fused_report). The ablation modes other than
"overlap" drop the field.

Under tensor parallelism (tp > 1) a plan may also carry the network nano-ops
(NETWORK_GROUPS): "o_allreduce" sums o_proj's partial outputs over the shards and adds the
residual, "mlp_allreduce" does the same after the MLP. On stream 3 they are left out of the
main stream's chain, so XLA's async all-reduce of one nano-batch can run under another's
GEMMs; on stream 0 they are chained like any other op (the ablation modes).
"""
from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path

from nanojax.config import ModelConfig
from nanojax.errors import NanojaxError

PLAN_VERSION = 1
OP_GROUPS = ("qkv", "attention", "o_proj", "mlp")  # the data order within a layer
PRODUCER = dict(zip(OP_GROUPS[1:], OP_GROUPS))     # op group -> the group it reads
GEMM_GROUPS = ("qkv", "o_proj", "mlp")  # the nano-ops a fused pair's GEMM side may be
FUSED_KEYS = ("attention", "gemm_programs", "programs")
NETWORK_GROUPS = ("o_allreduce", "mlp_allreduce")
TP_GROUPS = ("qkv", "attention", "o_proj", "o_allreduce", "mlp", "mlp_allreduce")


def groups_of(names) -> tuple[str, ...]:
    """The op groups, in data order, of a plan (or profile) that names these groups."""
    return TP_GROUPS if any(g in NETWORK_GROUPS for g in names) else OP_GROUPS


def producers(groups) -> dict[str, str]:
    """op group -> the group it reads."""
    return dict(zip(groups[1:], groups))


def plan_groups(plan: dict) -> tuple[str, ...]:
    return groups_of(plan["nano_batches"])
MODES = ("non-overlap", "nanobatch-only", "overlap")


class PlanError(NanojaxError):
    pass


def validate(plan: dict) -> dict:
    if not isinstance(plan, dict):
        raise PlanError("a plan must be a JSON object")
    if plan.get("version") != PLAN_VERSION:
        raise PlanError(f"plan version {plan.get('version')!r} is not supported "
                        f"(this nanojax reads version {PLAN_VERSION})")
    for key in ("model", "b_dense", "nano_batches", "nano_ops"):
        if key not in plan:
            raise PlanError(f"plan lacks '{key}'")
    b = plan["b_dense"]
    if not isinstance(b, int) or b <= 0:
        raise PlanError(f"plan b_dense must be a positive integer, got {b!r}")
    nb = plan["nano_batches"]
    if not isinstance(nb, dict):
        raise PlanError("plan nano_batches must be an object")
    groups = plan_groups(plan)
    if groups != OP_GROUPS and int(plan.get("tp", 1)) < 2:
        raise PlanError("network nano-ops (o_allreduce, mlp_allreduce) need tp > 1")
    for group in groups:
        ranges = nb.get(group)
        if not ranges:
            raise PlanError(f"plan has no nano-batches for op group '{group}'")
        pos = 0
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 2 and r[0] == pos and r[1] > r[0]):
                raise PlanError(f"nano-batches of '{group}' must tile [0, {b}) in order; "
                                f"got {ranges}")
            pos = r[1]
        if pos != b:
            raise PlanError(f"nano-batches of '{group}' end at {pos}, not at b_dense {b}")
    seen = set()
    for i, op in enumerate(plan["nano_ops"]):
        g, k = op.get("op"), op.get("batch")
        if g not in groups or not isinstance(k, int) or not 0 <= k < len(nb[g]):
            raise PlanError(f"nano_ops[{i}] names no nano-batch: {op}")
        if (g, k) in seen:
            raise PlanError(f"nano-op {g}[{k}] appears twice")
        seen.add((g, k))
        if op.get("stream", 0) not in (0, 1, 2, 3):
            raise PlanError(f"nano_ops[{i}] stream must be 0-3, got {op.get('stream')}")
        if not 0 < float(op.get("share", 1.0)) <= 1:
            raise PlanError(f"nano_ops[{i}] share must be in (0, 1], got {op.get('share')}")
    missing = {(g, k) for g in groups for k in range(len(nb[g]))} - seen
    if missing:
        raise PlanError(f"plan leaves nano-ops unscheduled: {sorted(missing)}")
    _validate_fused(plan, groups)
    return plan


def _overlaps(r, s) -> bool:
    return r[0] < s[1] and s[0] < r[1]


def _validate_fused(plan: dict, groups) -> None:
    """The fused pairs' rules (module docstring)."""
    nb, ops = plan["nano_batches"], plan["nano_ops"]
    producer = producers(groups)
    where = {(op["op"], op["batch"]): i for i, op in enumerate(ops)}
    paired: dict[int, str] = {}
    for i, op in enumerate(ops):
        f = op.get("fused")
        if f is None:
            continue
        name = f"{op['op']}[{op['batch']}]"
        if not isinstance(f, dict) or sorted(f) != sorted(FUSED_KEYS) or not all(
                isinstance(f[k], int) and not isinstance(f[k], bool) for k in FUSED_KEYS):
            raise PlanError(f"nano-op {name}: fused must be {{'attention': int, "
                            f"'gemm_programs': int, 'programs': int}}, got {f!r}")
        if op["op"] not in GEMM_GROUPS:
            raise PlanError(f"nano-op {name}: a fused pair is a GEMM nano-op "
                            f"({', '.join(GEMM_GROUPS)}) with a decode attention nano-op; "
                            f"{op['op']} is not a GEMM")
        j, g, n = f["attention"], f["gemm_programs"], f["programs"]
        if not 0 <= j < len(nb["attention"]):
            raise PlanError(f"nano-op {name} is fused with attention[{j}], which the plan "
                            f"does not have ({len(nb['attention'])} attention nano-batches)")
        if not 0 < g < n:
            raise PlanError(f"nano-op {name}: gemm_programs {g} out of range: both sides "
                            f"need programs, 0 < G < programs {n}")
        if j in paired:
            raise PlanError(f"attention[{j}] is fused with both {paired[j]} and {name}")
        paired[j] = name
        if abs(where[("attention", j)] - i) != 1:
            raise PlanError(f"nano-op {name} and attention[{j}] are fused but not adjacent "
                            "in nano_ops (one launch runs them at one point of the order)")
        att = ops[where[("attention", j)]]
        if op.get("stream", 0) != 0 or att.get("stream", 0) != 0:
            raise PlanError(f"fused pair {name} + attention[{j}]: both must be on stream 0 "
                            "(one launch splits the GPU by program, not by stream)")
        gemm_range, att_range = nb[op["op"]][op["batch"]], nb["attention"][j]
        if _overlaps(gemm_range, att_range):  # o_proj reads attention, attention reads qkv
            if producer.get(op["op"]) == "attention":
                raise PlanError(f"fused pair {name} + attention[{j}]: {name} reads "
                                f"attention[{j}]'s output, so they cannot run in one launch")
            if producer["attention"] == op["op"]:
                raise PlanError(f"fused pair {name} + attention[{j}]: attention[{j}] reads "
                                f"{name}'s output, so they cannot run in one launch")


def fused_pairs(plan: dict) -> dict[tuple[str, int], dict]:
    """(op, batch) of each side of a fused pair -> {"gemm": (op, batch), "attention": j,
    "gemm_programs": G, "programs": N}."""
    out = {}
    for op in plan["nano_ops"]:
        f = op.get("fused")
        if f is not None:
            pair = {"gemm": (op["op"], op["batch"]), **f}
            out[(op["op"], op["batch"])] = out[("attention", f["attention"])] = pair
    return out


def check_order(plan: dict) -> None:
    """Each nano-op must come after the nano-ops that produce its inputs."""
    nb = plan["nano_batches"]
    producer = producers(plan_groups(plan))
    done: set = set()
    for op in plan["nano_ops"]:
        g, k = op["op"], op["batch"]
        a, b = nb[g][k]
        if g in producer:
            p = producer[g]
            need = {(p, j) for j, (c, d) in enumerate(nb[p]) if c < b and a < d}
            if not need <= done:
                raise PlanError(f"nano-op {g}[{k}] is ordered before its inputs "
                                f"{sorted(need - done)}")
        done.add((g, k))


def check_model(plan: dict, cfg: ModelConfig, tp: int = 1) -> None:
    want = cfg.signature()
    diff = {k: (plan["model"].get(k), v) for k, v in want.items() if plan["model"].get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: plan {a} vs model {b}" for k, (a, b) in diff.items())
        raise PlanError(f"plan was made for another model ({detail})")
    if plan.get("tp", 1) != tp:
        raise PlanError(f"plan is for tensor parallelism {plan.get('tp', 1)}, not {tp}")


def load_plan(path_or_name: str | Path) -> dict:
    """A path to a JSON plan, or the name of a plan shipped in nanojax/plans."""
    p = Path(path_or_name)
    if not p.is_file():
        name = str(path_or_name).removesuffix(".json") + ".json"
        shipped = resources.files("nanojax.plans").joinpath(name)
        if not shipped.is_file():
            raise PlanError(f"no plan file {path_or_name}")
        text = shipped.read_text()
    else:
        text = p.read_text()
    try:
        return validate(json.loads(text))
    except json.JSONDecodeError as e:
        raise PlanError(f"plan {path_or_name} is not valid JSON: {e}") from None


def ablation(plan: dict, mode: str) -> dict:
    """non-overlap: one nano-batch per op, one stream; nanobatch-only: the plan's splits on
    one stream, no fused pairs; overlap: the plan as it is."""
    if mode not in MODES:
        raise PlanError(f"unknown mode {mode!r}; one of {MODES}")
    plan = copy.deepcopy(plan)
    if mode == "overlap":
        return plan
    if mode == "non-overlap":
        b = plan["b_dense"]
        groups = plan_groups(plan)
        plan["nano_batches"] = {g: [[0, b]] for g in groups}
        plan["nano_ops"] = [{"op": g, "batch": 0, "stream": 0, "share": 1.0}
                            for g in groups]
        return plan
    plan["nano_ops"] = [{**{k: v for k, v in op.items() if k != "fused"}, "stream": 0,
                         "share": 1.0} for op in plan["nano_ops"]]
    return plan


def single_device(plan: dict) -> dict:
    """The non-overlap plan of the same model and B_dense on one device (no network
    nano-ops): the yardstick a tensor-parallel run's numerics are measured against."""
    plan = ablation(plan, "non-overlap")
    plan["tp"] = 1
    plan["nano_batches"] = {g: r for g, r in plan["nano_batches"].items()
                            if g not in NETWORK_GROUPS}
    plan["nano_ops"] = [op for op in plan["nano_ops"] if op["op"] not in NETWORK_GROUPS]
    return validate(plan)


def resize(plan: dict, b_dense: int) -> dict:
    """The plan's splits scaled to another B_dense (cuts rounded to the plan's granularity
    where the batch allows), for sweeps over B_dense with one searched plan."""
    plan = copy.deepcopy(plan)
    old, gran = plan["b_dense"], int(plan.get("granularity", 1))
    if gran * 8 > b_dense:
        gran = 1
    for g in plan_groups(plan):
        cuts = [round(b * b_dense / old / gran) * gran for _, b in plan["nano_batches"][g]]
        cuts[-1] = b_dense
        ranges: list[list[int]] = []
        pos = 0
        for c in cuts:  # a cut that collapses onto the previous one keeps one token
            c = min(max(c, pos + 1), b_dense - (len(cuts) - len(ranges) - 1))
            ranges.append([pos, c])
            pos = c
        plan["nano_batches"][g] = ranges
    plan["b_dense"] = b_dense
    return validate(plan)
