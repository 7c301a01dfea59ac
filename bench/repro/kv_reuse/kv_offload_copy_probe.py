"""How copying KV pages to the host disturbs the engine thread (issue 21's offload cost).

A stand-in engine loop: a jitted step of about STEP_MS of device work, one step in flight,
HOST_MS of Python work on the loop thread each iteration (the engine needs the GIL for its
scheduling). Every iteration also gathers PAGES pages of PAGE_BYTES from a pool, as the
offloader does for finished requests, and hands the gather to a background thread that
copies it to the host by one METHOD:
  none      no copy (the baseline loop)
  async     copy_to_host_async() on the loop thread, np.asarray in the worker (the
            offloader before 2026-12-01 evening)
  worker    np.asarray in the worker only
  pinned    jax.device_put to pinned_host in the worker, then np.asarray (zero copy)
  offloader the real KVOffloader (host tier) fed by the same gathers (a forced flush
            every iteration: one gather each, as the engine's before batching)
and, the other way, LOAD_PAGES host pages scattered into the pool each iteration before
the next step (a returning conversation's pages), by one of:
  load_numpy    rows stacked in numpy on the loop thread, passed to the jitted scatter
                (the offloader's `load` as of 2026-12-01)
  load_pinned   the same rows put in pinned host memory, then on the device, then scattered
  load_staged   a worker thread stages the rows on the device ahead (pinned, then device);
                the loop thread only dispatches the scatter
Per method: iterations/s against `none`, the loop's slowest iterations, and host copy
throughput. One process, methods interleaved in rounds (METHOD.md: same-call ratios).
Usage: python bench/repro/kv_reuse/kv_offload_copy_probe.py OUT.json [--pool-gb 16]
CPU dry run: --pool-gb 0.05 --page-kb 64 --step-dim 256 --iters 6
"""
from __future__ import annotations

import argparse
import json
import queue
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.engine.kv_offload import KVOffloader
from nanojax.profiling.record import environment

SAVES = ("none", "async", "worker", "pinned", "offloader")
LOADS = ("load_numpy", "load_pinned", "load_staged")
METHODS = SAVES + LOADS


def make_step(dim: int, reps: int):
    @jax.jit
    def step(x):
        for _ in range(reps):
            x = jnp.tanh(x @ x) * 0.5
        return x
    return step


def host_work(ms: float) -> None:
    """Python-level work holding the GIL, like scheduling a batch."""
    end = time.perf_counter() + ms / 1e3
    acc = 0
    while time.perf_counter() < end:
        acc += sum(range(200))


def run(method: str, args, pool, step, gather, x0, pages_per_iter: int, rng,
        scatter=None, entries=()) -> dict:
    q: queue.Queue = queue.Queue()
    copied = [0, 0.0]  # bytes, seconds inside the worker
    offloader = None
    if method == "offloader":
        runner = types.SimpleNamespace(kv=[pool])
        runner.with_kv = lambda fn: fn(runner.kv)
        runner.update_kv = lambda fn: setattr(runner, "kv", fn(runner.kv))
        offloader = KVOffloader(runner, pool.shape[0], 0, b"probe",
                                host_bytes=int(args.host_gb * (1 << 30)))
        offloader.save(list(range(pages_per_iter)),  # its gather compiled before the clock
                       [b"warm" + i.to_bytes(12, "little") for i in range(pages_per_iter)])
        offloader.flush(force=True)
        offloader.drain()

    def worker():
        while (item := q.get()) is not None:
            t = time.perf_counter()
            if method == "pinned":
                item = jax.device_put(item, item.sharding.with_memory_kind("pinned_host"))
            h = np.asarray(item)
            copied[0] += h.nbytes
            copied[1] += time.perf_counter() - t
            q.task_done()
        q.task_done()

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    pool_ref = [pool]
    rows_ahead: queue.Queue = queue.Queue()

    def to_device(rows):
        dev = jax.devices()[0]
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        return jax.device_put(jax.device_put(rows, pinned), jax.sharding.SingleDeviceSharding(dev))

    if method == "load_staged":  # a stand-in for staging at the request's arrival
        def stage():
            for _ in range(args.iters):
                rows_ahead.put(to_device(np.stack(entries)))
        threading.Thread(target=stage, daemon=True).start()

    def load(how, ref, ahead):
        idx = rng.choice(pool.shape[0], args.load_pages, replace=False).astype(np.int32)
        if how == "load_numpy":
            rows = np.stack(entries)
        elif how == "load_pinned":
            rows = to_device(np.stack(entries))
        else:
            rows = ahead.get()
        ref[0] = scatter(ref[0], idx, rows)
    x = step(x0)
    times = []
    serial = 0
    t0 = time.perf_counter()
    for it in range(args.iters):
        ts = time.perf_counter()
        host_work(args.host_ms)
        nxt = step(x)                       # dispatch the next step, then wait for this one
        if method in LOADS:
            load(method, pool_ref, rows_ahead)
        elif method != "none":
            idx = rng.choice(pool.shape[0], pages_per_iter, replace=False).astype(np.int32)
            if offloader is not None:
                hashes = [serial.to_bytes(8, "little") + bytes(8) for serial in
                          range(serial, serial + pages_per_iter)]
                serial += pages_per_iter
                offloader.save(list(idx), hashes)
                offloader.flush(force=True)
            else:
                g = gather(pool, idx)
                if method == "async":
                    g.copy_to_host_async()
                q.put(g)
        jax.block_until_ready(x)
        x = nxt
        times.append(time.perf_counter() - ts)
    jax.block_until_ready((x, pool_ref[0]))
    wall = time.perf_counter() - t0
    q.put(None)
    q.join()
    out = {"_pool": pool_ref[0]} if method in LOADS else {}
    out |= {"iters_per_s": args.iters / wall, "wall_s": wall,
           "p50_ms": 1e3 * float(np.median(times)), "max_ms": 1e3 * max(times)}
    if copied[1]:
        out["worker_gb_per_s"] = copied[0] / copied[1] / 1e9
    if offloader is not None:
        offloader.drain()
        out["offloader"] = {"saved_pages": offloader.stats.saved_pages,
                            "saves_dropped": offloader.stats.saves_dropped}
        offloader.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--pool-gb", type=float, default=16.0)
    ap.add_argument("--page-kb", type=int, default=2048, help="LLaMA-3-8B: 2 MiB a page")
    ap.add_argument("--pages", type=int, default=128, help="pages saved per iteration")
    ap.add_argument("--load-pages", type=int, default=64, help="pages loaded per iteration")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--step-dim", type=int, default=8192)
    ap.add_argument("--step-reps", type=int, default=20)
    ap.add_argument("--host-ms", type=float, default=15.0)
    ap.add_argument("--host-gb", type=float, default=8.0, help="offloader's host tier")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    page = args.page_kb * 1024
    num_pages = int(args.pool_gb * (1 << 30)) // page
    pool = jnp.zeros((num_pages, page), jnp.uint8)
    step = make_step(args.step_dim, args.step_reps)
    gather = jax.jit(lambda p, idx: jnp.take(p, idx, axis=0))
    jax.block_until_ready(gather(pool, np.arange(args.pages, dtype=np.int32)))
    x0 = jnp.full((args.step_dim, args.step_dim), 0.01, jnp.bfloat16)
    # donated like the engine's cache: the load lands in place
    scatter = jax.jit(lambda p, idx, rows: p.at[idx].set(rows), donate_argnums=(0,))
    entries = [np.full(page, i % 251, np.uint8) for i in range(args.load_pages)]
    pool = scatter(pool, np.arange(args.load_pages, dtype=np.int32), np.stack(entries))
    rng = np.random.default_rng(0)
    methods = args.methods.split(",")
    if "none" not in methods or set(methods) - set(METHODS):
        ap.error(f"--methods: a subset of {','.join(METHODS)} that includes none")
    res: dict = {m: [] for m in methods}
    for r in range(args.rounds):
        for m in methods:
            res[m].append(run(m, args, pool, step, gather, x0, args.pages, rng, scatter,
                              entries))
            if m in LOADS:  # the scatter donated the pool: carry on with its result
                pool = res[m][-1].pop("_pool")
            print(f"round {r} {m:9s} " + json.dumps(res[m][-1]), flush=True)
    base = np.mean([x["iters_per_s"] for x in res["none"][1:] or res["none"]])
    summary = {m: np.mean([x["iters_per_s"] for x in v[1:] or v]) / base
               for m, v in res.items()}
    print("iterations/s against none:", json.dumps(summary))
    with open(args.out, "w") as f:
        json.dump({"command": "python bench/repro/kv_reuse/kv_offload_copy_probe.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
            "env": environment(), "pages_per_iteration_bytes": args.pages * page,
            "runs": res, "over_none": summary}, f, indent=1)


if __name__ == "__main__":
    main()
