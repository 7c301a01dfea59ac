"""Time on-device work without dispatch in the way: the op runs `iters` times inside one
jitted loop, median of repeats (DESIGN.md: separately jitted calls each pay ~0.1 ms)."""
from __future__ import annotations

import time

import jax
import numpy as np
from jax import lax


def device_seconds(fn, *args, iters: int = 20, reps: int = 5) -> float:
    """Seconds per call of fn(*args). The arguments and the last output pass through an
    optimization barrier every iteration, so XLA can neither hoist the work out of the
    loop nor shrink it to the part that is used."""
    out0 = jax.eval_shape(fn, *args)

    def loop(args):
        def body(i, carry):
            a, _ = lax.optimization_barrier(carry)
            return a, fn(*a)
        zeros = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out0)
        return lax.fori_loop(0, iters, body, (args, zeros))[1]

    f = jax.jit(loop)
    jax.block_until_ready(f(args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(args))
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))
