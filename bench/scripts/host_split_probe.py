"""How fast the offload worker can cut a gathered chunk of pages into per-page host rows,
alone and beside a thread that runs pure Python the whole time (the engine loop holds
the GIL for most of an iteration), and how much of the busy thread's time each method
takes per MB copied. Writes JSON; CPU only.

    python bench/scripts/host_split_probe.py OUT.json [--pages 128] [--page-mib 2]

Methods: `copy` (ndarray.copy per page: numpy releases the GIL around each copy and
must win it back from the busy thread, up to a switch interval each time), `tobytes`
(one memcpy per page with the GIL held: np.frombuffer over bytes), `chunk` (what
PageCopier.split does: one copy of the chunk without the GIL, pages as views of it),
`chunk_reused` (the same copy into a block allocated once: no page faults on fresh
memory, a bound for pooling blocks, which the tier does not do).

Busy-thread stall: its loop count during the copies against its rate alone just before,
as seconds lost per MB copied (a core shared with other work also shows up here)."""
import argparse
import json
import os
import platform
import sys
import threading
import time

import numpy as np


def split(kind: str, host: np.ndarray, reused: np.ndarray) -> list:
    if kind == "copy":
        return [host[i].copy() for i in range(len(host))]
    if kind == "tobytes":
        return [np.frombuffer(host[i].tobytes(), np.uint8) for i in range(len(host))]
    if kind == "chunk":
        return list(np.array(host))
    np.copyto(reused, host)
    return list(reused)


class Busy:
    """A thread of pure Python counting its loops (the engine thread's stand-in)."""

    def __init__(self):
        self.count, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self):
        x = 0
        while not self.stop.is_set():
            for i in range(1000):
                x += i
            self.count += 1

    def __enter__(self):
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def window(busy: Busy, seconds: float) -> tuple[float, int]:
    c, t = busy.count, time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - t, busy.count - c


def measure(kind: str, host: np.ndarray, reps: int) -> dict:
    reused = np.empty_like(host)
    split(kind, host, reused)  # warm
    t = time.perf_counter()
    for _ in range(reps):
        split(kind, host, reused)
    alone = reps * host.nbytes / (time.perf_counter() - t)
    with Busy() as busy:
        dt0, n0 = window(busy, 0.5)  # its pace with nothing to copy
        c, t = busy.count, time.perf_counter()
        for _ in range(reps):
            split(kind, host, reused)
        dt, n = time.perf_counter() - t, busy.count - c
    lost = max(0.0, dt - n / (n0 / dt0))  # busy-thread seconds the copies took away
    mb = reps * host.nbytes / 1e6
    return {"alone_gb_s": alone / 1e9, "beside_busy_python_thread_gb_s": mb / 1e3 / dt,
            "busy_thread_pace_during_copy": n / dt / (n0 / dt0),
            "busy_thread_stall_ms_per_mb": 1e3 * lost / mb}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-mib", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--trials", type=int, default=3, help="rounds over all methods")
    a = ap.parse_args()
    host = np.random.default_rng(0).integers(0, 255, (a.pages, a.page_mib << 20), np.uint8)
    kinds = ("copy", "tobytes", "chunk", "chunk_reused")
    trials = {k: [] for k in kinds}
    for trial in range(a.trials):  # interleaved: a load change hits every method alike
        for kind in kinds:
            r = measure(kind, host, a.reps)
            trials[kind].append(r)
            print(trial, kind, ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    rows = {k: {m: float(np.median([r[m] for r in rs])) for m in rs[0]}
            for k, rs in trials.items()}
    for k, r in rows.items():
        print("median", k, ", ".join(f"{m} {v:.3f}" for m, v in r.items()))
    out = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "config": vars(a), "machine": {"cpus": os.cpu_count(),
                                          "python": platform.python_version(),
                                          "numpy": np.__version__,
                                          "switch_interval_s": sys.getswitchinterval(),
                                          "load_average": os.getloadavg()},
           "results_median": rows, "trials": trials}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
