"""Placing a region of the step on an XLA execution stream (GPU only).

XLA assigns a stream to an annotated call, and only to a flat one: a nested call inside the
region (every `jax.jit`-decorated library function: jnp.einsum, jax.nn.silu, ...) fails with
"No ExecutionStreamId found for call-start". So the region is traced to a jaxpr, every call
in it is inlined, and the flat result is what gets annotated.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import jax
from jax.extend import core as jex_core

# primitives that wrap a sub-jaxpr; the region evaluates their body in place
_CALL_PARAMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
                "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
                "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
                "remat": "jaxpr", "checkpoint": "jaxpr"}


# XLA needs these before the backend starts for stream-annotated regions to run
# concurrently; harmless off the GPU. Command buffers (CUDA graphs) are off: inside one,
# the H200 trace showed every kernel of the step serialised on one stream, stream
# annotations notwithstanding (XLA chains a command buffer's async regions serially).
STREAM_XLA_FLAGS = ("--xla_gpu_experimental_stream_annotation=true",
                    "--xla_gpu_enable_latency_hiding_scheduler=true",
                    "--xla_gpu_experimental_parallel_async_compute_limit=2",
                    "--xla_gpu_enable_command_buffer=")


def add_stream_xla_flags() -> None:
    """Adds STREAM_XLA_FLAGS to XLA_FLAGS (those not already set there). Call it before
    the first jax computation: XLA reads its flags once, when the backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in STREAM_XLA_FLAGS if f.split("=")[0] not in flags]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()


def streams_enabled(enabled: bool = True) -> bool:
    """Stream placement happens on a GPU, when the KernelConfig asks for it."""
    return enabled and jax.default_backend() == "gpu"


def _eval_inlined(jaxpr, consts, args, seen=None):
    """Evaluates jaxpr with every nested call inlined; seen, if a list, collects every
    intermediate value (the `keep_intermediates` diagnostic below)."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        key = _CALL_PARAMS.get(eqn.primitive.name)
        if key is not None and key in eqn.params:
            inner = eqn.params[key]
            if hasattr(inner, "consts"):  # a ClosedJaxpr
                outs = _eval_inlined(inner.jaxpr, inner.consts, ins, seen)
            else:
                outs = _eval_inlined(inner, [], ins, seen)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns = ()
            if isinstance(params, tuple):  # older jax: (subfuns, params)
                subfuns, params = params
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *ins, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
            if seen is not None and key is None:
                seen.append(x)
    return [read(v) for v in jaxpr.outvars]


def inline_calls(fn, keep_intermediates: int = 0):
    """fn with every nested call (jit, custom_jvp, ...) inlined: one flat computation.
    keep_intermediates > 0: a diagnostic; the flat function returns (outputs, every
    intermediate value of at most that many bytes), so each one gets a buffer of its own
    that lives as long as the region's outputs."""
    def flat(*args):
        leaves, _ = jax.tree_util.tree_flatten(args)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        seen: list | None = [] if keep_intermediates else None
        outs = _eval_inlined(closed.jaxpr, closed.consts, leaves, seen)
        outs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
        if seen is None:
            return outs
        return outs, [x for x in seen if x.size * x.dtype.itemsize <= keep_intermediates]
    return flat


@contextlib.contextmanager
def scheduling_group(group_id):
    """Tags the ops traced inside with an XLA scheduling group (nothing when None); the
    stream regions among them carry it to their async start/done (see below)."""
    if group_id is None:
        yield
        return
    from jax.experimental.xla_metadata import set_xla_metadata
    with set_xla_metadata(_scheduling_group_id=str(group_id)):
        yield


_METADATA_ON_CALLS: list[bool] = []


def carry_metadata_to_stream_calls() -> bool:
    """Makes XLA metadata (`set_xla_metadata`, here the scheduling group) land on the call
    that a stream-annotated region lowers to. jax puts it on the region's outputs (device-
    placement custom calls) instead; XLA builds the async start/done from the call, and
    its scheduler keeps a group's ops between start and done only when the pair carries
    the group id. Installed once; False where this jax's internals differ (no groups)."""
    if _METADATA_ON_CALLS:
        return _METADATA_ON_CALLS[0]
    ok = False
    try:
        import jax.experimental.compute_on as co
        from jax._src import core
        from jax._src.interpreters import mlir
        # the function form: its signature differs between jax versions (see on_stream)
        annotate: Callable[..., Any] = getattr(co, "compute_on2", None) or co.compute_on
        probe = jax.make_jaxpr(annotate(lambda y: y, compute_type="gpu_stream:1",
                                        out_memory_spaces=core.MemorySpace.Device))
        prim = probe(jax.numpy.zeros(2)).eqns[0].primitive
        entry = mlir._lowerings[prim]
        rule = getattr(entry, "rule", entry)  # older jax: the entry is the rule itself

        def rule_with_metadata(ctx, *args, **params):
            outs = rule(ctx, *args, **params)  # type: ignore[operator]  # jax-private entry types vary by version
            meta = getattr(ctx.jaxpr_eqn_ctx, "xla_metadata", None)
            if meta:
                for o in jax.tree_util.tree_leaves(outs):
                    op = mlir._get_owner(o)
                    while op.name == "stablehlo.custom_call":  # output placement markers
                        op = mlir._get_owner(op.operands[0])
                    if op.name == "func.call":
                        mlir._update_frontend_attributes(op, {
                            k: mlir.ir.StringAttr.get(str(v)) for k, v in meta.items()})
            return outs
        try:
            mlir.register_lowering(prim, rule_with_metadata, cacheable=False)
        except TypeError:  # a jax without the cacheable flag
            mlir.register_lowering(prim, rule_with_metadata)
        ok = True
    except Exception:  # noqa: BLE001 - private API moved: run without groups
        ok = False
    _METADATA_ON_CALLS.append(ok)
    return ok


def on_stream(fn, stream: int, keep_intermediates: int = 0, enabled: bool = True):
    """Place fn on XLA execution stream `stream` (0: the main stream, left alone; also
    when not `enabled` or off the GPU). jax 0.10 spells the function form
    `compute_on2(f, ...)`, jax 0.11 `compute_on(f, ...)`. keep_intermediates: see
    inline_calls (then the result is (outputs, intermediates))."""
    if stream == 0 or not streams_enabled(enabled):
        if keep_intermediates:
            return inline_calls(fn, keep_intermediates)
        return fn
    import jax.experimental.compute_on as co
    from jax._src import core
    # the function form: its signature differs between jax versions (see the docstring)
    annotate: Callable[..., Any] = getattr(co, "compute_on2", None) or co.compute_on
    flat = inline_calls(fn, keep_intermediates)

    def placed(*args):
        spaces = jax.tree_util.tree_map(lambda _: core.MemorySpace.Device,
                                        jax.eval_shape(flat, *args))
        return annotate(flat, compute_type=f"gpu_stream:{stream}",
                        out_memory_spaces=spaces)(*args)
    return placed
