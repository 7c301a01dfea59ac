"""`--plan NAME|PATH|auto`: the plan, if any, that the engine's forward runs.

NAME or PATH: that plan; it must match the model (check_model), and is resized to the
engine's B_dense when made for another. auto: on a GPU, the shipped plan (nanojax/plans)
that matches the model, preferring one made for this B_dense (else the nearest, resized);
no plan when none matches, or off the GPU, where nano-batches cannot overlap and only
cost extra weight reads.
"""
from __future__ import annotations

from importlib import resources

from nanojax.config import ModelConfig
from nanojax.pipeline.plan import PlanError, check_model, load_plan, resize

AUTO = "auto"


def shipped_plans() -> list[str]:
    return sorted(f.name.removesuffix(".json") for f in resources.files("nanojax.plans")
                  .iterdir() if f.name.endswith(".json"))


def _fit(plan: dict, b_dense: int, name: str) -> tuple[dict, str]:
    if plan["b_dense"] == b_dense:
        return plan, f"plan {name} (B_dense {b_dense})"
    return resize(plan, b_dense), f"plan {name}, resized from B_dense {plan['b_dense']} " \
                                  f"to {b_dense}"


def choose_plan(spec: str | None, cfg: ModelConfig, b_dense: int,
                backend: str | None = None) -> tuple[dict | None, str]:
    """(the plan or None, one line saying which and why, for the log)."""
    if spec is None:
        return None, "no plan: the plain forward"
    if spec != AUTO:
        plan = load_plan(spec)
        check_model(plan, cfg)
        return _fit(plan, b_dense, spec)
    if backend is None:
        import jax
        backend = jax.default_backend()
    if backend != "gpu":
        return None, f"--plan auto: no plan on the {backend} (nano-batches overlap only on " \
                     "a GPU)"
    matching = []
    for name in shipped_plans():
        plan = load_plan(name)
        try:
            check_model(plan, cfg)
        except PlanError:
            continue
        matching.append((plan["b_dense"] != b_dense, abs(plan["b_dense"] - b_dense), name,
                         plan))
    if not matching:
        return None, f"--plan auto: no shipped plan ({', '.join(shipped_plans())}) matches " \
                     f"this model {cfg.signature()}; running without one"
    *_, name, plan = min(matching, key=lambda m: m[:3])
    plan, what = _fit(plan, b_dense, name)
    return plan, "--plan auto: " + what
