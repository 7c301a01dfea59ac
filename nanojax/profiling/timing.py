"""Time on-device work without dispatch in the way: the op runs `iters` times inside one
jitted loop, median of repeats (separately jitted calls each pay a dispatch, as long as a
small kernel on the H200)."""
from __future__ import annotations

import time

import jax
import numpy as np
from jax import lax


def device_seconds(fn, *args, iters: int = 20, reps: int = 5,
                   compiler_options: dict | None = None) -> float:
    """Seconds per call of fn(*args). The arguments and the last output pass through an
    optimization barrier every iteration, so XLA can neither hoist the work out of the
    loop nor shrink it to the part that is used. compiler_options: XLA options of the
    loop's compile (a forward's, so an op is timed as the step compiles it)."""
    out0 = jax.eval_shape(fn, *args)

    def loop(args):
        def body(i, carry):
            a, _ = lax.optimization_barrier(carry)
            return a, fn(*a)
        zeros = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out0)
        return lax.fori_loop(0, iters, body, (args, zeros))[1]

    return _median_per_call(jax.jit(loop, compiler_options=compiler_options or None),
                            lambda f: f(args), iters, reps)


def device_seconds_stateful(fn, state, *args, iters: int = 20, reps: int = 5) -> float:
    """Seconds per call of `state, out = fn(state, *args)` with the state threaded through
    the loop (and donated), as a KV cache is between steps: an in-place update stays in
    place instead of copying the whole state every call."""
    def loop(state, args):
        def body(i, carry):
            st, acc = carry
            a = lax.optimization_barrier(args)
            st, out = fn(st, *a)
            leaf = jax.tree_util.tree_leaves(out)[0]
            return st, acc + leaf.reshape(-1)[0].astype(np.float32)
        return lax.fori_loop(0, iters, body, (state, np.float32(0)))

    box = [state]

    def call(f):  # the state goes in donated and comes back for the next call
        box[0], acc = f(box[0], args)
        return acc
    return _median_per_call(jax.jit(loop, donate_argnums=(0,)), call, iters, reps)


def _median_per_call(f, call, iters: int, reps: int) -> float:
    """Warm up (compile), then the median over reps of call(f)'s time / iters."""
    jax.block_until_ready(call(f))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(call(f))
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))
