"""Does handing a jitted step its inputs as numpy arrays stall the device between steps?

The engine launches step N+1 while step N runs, passing ~15 numpy arrays (tokens, slots,
page table, sampling rows). On the H200 (bench/results §34) its launch took 43.5 ms per
iteration, of which building the arrays is a few ms, and the device idled ~6 ms between
steps, with step N+1's host-to-device copies starting only after step N ended. This probe
runs a stand-in step (a chain of matmuls, ~STEP_MS) in the same pattern, dispatch one
ahead, tokens read back one behind, and times per iteration the launch call and the
whole iteration against the step alone (the step donates a state buffer in place, as the
engine donates its KV cache; --no-donate: it does not), for three ways of passing inputs:
  numpy    the arrays as they are (what the engine does)
  put      one jax.device_put of the whole input tree to the device first
  pinned   device_put to pinned host memory, then to the device
Writes JSON. Usage: python bench/scripts/input_transfer_probe.py OUT.json [--iters 30]
"""
import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def make_inputs(rng, rows: int, tokens: int, width: int) -> dict:
    return {"tokens": rng.integers(0, 1000, tokens, dtype=np.int32),
            "positions": rng.integers(0, 1000, tokens, dtype=np.int32),
            "slots": rng.integers(0, 10**6, tokens, dtype=np.int32),
            "seq_ids": rng.integers(0, rows, tokens, dtype=np.int32),
            "page_table": rng.integers(0, 50000, (rows, width), dtype=np.int32),
            "context_lens": rng.integers(1, 1024, rows, dtype=np.int32),
            "logit_idx": rng.integers(0, tokens, rows, dtype=np.int32),
            "temperature": np.zeros(rows, np.float32), "top_p": np.ones(rows, np.float32),
            "top_k": np.full(rows, -1, np.int32), "seeds": np.zeros(rows, np.uint32),
            "steps": np.zeros(rows, np.int32)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--chain", type=int, default=0, help="matmuls per step (0: ~90 ms)")
    ap.add_argument("--rows", type=int, default=1152)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--state-mib", type=int, default=1024, help="the donated buffer")
    ap.add_argument("--no-donate", action="store_true")
    a = ap.parse_args()
    dev = jax.devices()[0]
    w = jax.device_put(jnp.ones((a.dim, a.dim), jnp.bfloat16) * 1e-3, dev)
    x0 = jax.device_put(jnp.ones((a.tokens, a.dim), jnp.bfloat16), dev)

    state0 = jax.device_put(jnp.zeros((a.state_mib << 19,), jnp.bfloat16), dev)

    def step(w, x, state, inp, chain):
        for _ in range(chain):
            x = jnp.tanh(x @ w)
        s = sum(jnp.sum(v.astype(jnp.float32)) for v in inp.values())
        state = state.at[inp["slots"] % state.shape[0]].set(x[:, 0])  # an in-place write
        return x, state, (x[:a.rows, 0] + s).astype(jnp.float32)

    chain = a.chain
    rng = np.random.default_rng(0)
    inputs = [make_inputs(rng, a.rows, a.tokens, 64) for _ in range(4)]
    if not chain:  # size the chain to ~90 ms a step on this device
        f = jax.jit(step, static_argnums=4)
        jax.block_until_ready(f(w, x0, state0, inputs[0], 4))
        t = time.perf_counter()
        jax.block_until_ready(f(w, x0, state0, inputs[0], 4))
        chain = max(1, int(4 * 0.09 / (time.perf_counter() - t)))
    f = jax.jit(lambda w, x, state, inp: step(w, x, state, inp, chain),
                donate_argnums=() if a.no_donate else (2,))
    state = jnp.copy(state0)
    pinned = None
    try:
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    except Exception:  # noqa: BLE001 - a backend without pinned host memory
        pass
    dev_sharding = jax.sharding.SingleDeviceSharding(dev)

    def place(kind, inp):
        if kind == "numpy":
            return inp
        if kind == "put":
            return jax.device_put(inp, dev_sharding)
        return jax.device_put(jax.device_put(inp, pinned), dev_sharding)

    # the step alone, back to back on device-resident inputs
    placed = jax.device_put(inputs[0], dev_sharding)
    x, state, out = f(w, x0, state, placed)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(a.iters):
        x, state, out = f(w, x, state, placed)
    jax.block_until_ready(out)
    step_ms = (time.perf_counter() - t) / a.iters * 1e3
    rows = {"step_alone_ms": step_ms, "chain": chain}
    for kind in ("numpy", "put") + (("pinned",) if pinned is not None else ()):
        x, state, prev = f(w, x0, state, place(kind, inputs[0]))
        jax.block_until_ready(prev)
        launch = []
        t0 = time.perf_counter()
        for i in range(a.iters):
            t = time.perf_counter()
            x, state, out = f(w, x, state, place(kind, inputs[i % 4]))  # launch N+1 ...
            launch.append(time.perf_counter() - t)
            np.asarray(prev)  # ... then read N, as the engine does
            prev = out
        np.asarray(prev)
        iter_ms = (time.perf_counter() - t0) / a.iters * 1e3
        rows[kind] = {"iteration_ms": iter_ms, "launch_ms_mean": 1e3 * float(np.mean(launch)),
                      "over_step_alone": iter_ms / step_ms}
        print(kind, rows[kind], file=sys.stderr, flush=True)
    out = {"command": "python " + " ".join(sys.argv), "config": vars(a),
           "device": str(dev), "jax": jax.__version__, "results": rows}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
