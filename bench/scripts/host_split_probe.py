"""How fast the offload worker can cut a gathered chunk of pages into per-page host rows,
alone and beside a thread that runs pure Python the whole time (the engine loop holds
the GIL for most of an iteration). Writes JSON; CPU only.

    python bench/scripts/host_split_probe.py OUT.json [--pages 128] [--page-mib 2]

Methods: `copy` (ndarray.copy per page: numpy releases the GIL around each copy and
must win it back from the busy thread, up to a switch interval each time), `tobytes`
(one memcpy per page with the GIL held: np.frombuffer over bytes), `one_copy` (one copy of
the whole chunk, pages as views of it: what the tier cannot keep, listed as a bound)."""
import argparse
import json
import os
import platform
import sys
import threading
import time

import numpy as np


def split(kind: str, host: np.ndarray) -> list:
    if kind == "copy":
        return [host[i].copy() for i in range(len(host))]
    if kind == "tobytes":
        return [np.frombuffer(host[i].tobytes(), np.uint8) for i in range(len(host))]
    whole = host.copy()
    return list(whole)


def rate(kind: str, host: np.ndarray, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        split(kind, host)
    return reps * host.nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-mib", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    host = np.random.default_rng(0).integers(0, 255, (a.pages, a.page_mib << 20), np.uint8)
    stop = threading.Event()

    def busy():
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    rows = {}
    for kind in ("copy", "tobytes", "one_copy"):
        alone = rate(kind, host, a.reps)
        stop.clear()
        t = threading.Thread(target=busy)
        t.start()
        beside = rate(kind, host, a.reps)
        stop.set()
        t.join()
        rows[kind] = {"alone_gb_s": alone, "beside_busy_python_thread_gb_s": beside}
        print(kind, f"alone {alone:.2f} GB/s, beside a busy thread {beside:.2f} GB/s")
    out = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "config": vars(a), "machine": {"cpus": os.cpu_count(),
                                          "python": platform.python_version(),
                                          "numpy": np.__version__,
                                          "switch_interval_s": sys.getswitchinterval(),
                                          "load_average": os.getloadavg()},
           "results": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
