"""Start times with jax's persistent compilation cache (issue 20, item 3): runs one nanojax
command several times with one fresh cache directory and writes the wall times as JSON.

    python bench/repro/engine_host/start_times.py OUT.json --runs 2 -- generate Hello --max-tokens 16
    python bench/repro/engine_host/start_times.py OUT.json --listen -- serve --model random:llama3-8b

--listen: the command is a server; the time is until /health answers 200, then it gets
SIGTERM. Otherwise the time is the process's whole wall time. --trials T repeats the whole
thing (each with its own fresh cache) to show the spread on a shared machine.
"""
import argparse
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(cmd: list, cache: str, listen: bool, timeout: float) -> dict:
    full = [sys.executable, "-m", "nanojax", *cmd, "--compile-cache-dir", cache]
    port = None
    if listen:
        port = free_port()
        full += ["--port", str(port)]
    t0 = time.monotonic()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if listen:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}: "
                                       f"{proc.stdout.read()[-2000:]}")
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"no /health within {timeout} s")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                                timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.2)
            wall = time.monotonic() - t0
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
        else:
            out, _ = proc.communicate(timeout=timeout)
            wall = time.monotonic() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {out[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # whole process, to its exit
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    tail = [line for line in out.splitlines() if line.startswith("nanojax:")]
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "log": tail[-4:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=2, help="starts per trial, one cache")
    ap.add_argument("--trials", type=int, default=1, help="each with a fresh cache")
    ap.add_argument("--listen", action="store_true")
    ap.add_argument("--cache-dir", help="this (empty) directory as the one trial's cache, "
                    "kept after (e.g. for a benchmark that follows); default: a fresh "
                    "temporary one per trial, removed")
    ap.add_argument("--timeout", type=float, default=600)
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("give the nanojax command after --")
    split = argv.index("--")
    a, cmd = ap.parse_args(argv[:split]), argv[split + 1:]
    if a.cache_dir and (a.trials != 1 or (os.path.isdir(a.cache_dir)
                                          and os.listdir(a.cache_dir))):
        ap.error("--cache-dir: one trial, and the directory empty (a first start is cold)")
    trials, load0 = [], os.getloadavg()
    for _ in range(a.trials):
        cache = a.cache_dir or tempfile.mkdtemp(prefix="nanojax-compile-cache-")
        os.makedirs(cache, exist_ok=True)
        try:
            runs = [run_once(cmd, cache, a.listen, a.timeout) for _ in range(a.runs)]
            files = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
            trials.append({"runs": runs, "second_over_first": round(
                runs[1]["wall_s"] / runs[0]["wall_s"], 3) if len(runs) > 1 else None,
                "second_over_first_cpu": round(runs[1]["cpu_s"] / runs[0]["cpu_s"], 3)
                if len(runs) > 1 else None,
                "cache_entries": len(files),
                "cache_bytes": sum(os.path.getsize(f) for f in files)})
        finally:
            if not a.cache_dir:
                shutil.rmtree(cache, ignore_errors=True)
        print(json.dumps(trials[-1]), file=sys.stderr)
    ratios = [t["second_over_first"] for t in trials if t["second_over_first"]]
    cpu_ratios = [t["second_over_first_cpu"] for t in trials if t["second_over_first_cpu"]]
    payload = {"command": "nanojax " + " ".join(cmd), "measure": "time to /health 200"
               if a.listen else "process wall time", "trials": trials,
               "second_over_first": {"min": min(ratios), "max": max(ratios)} if ratios
               else None, "second_over_first_cpu": {"min": min(cpu_ratios),
                                                    "max": max(cpu_ratios)} if cpu_ratios
               else None, "host": platform.node(), "cpus": os.cpu_count(),
               "load_average_at_start": load0, "load_average_at_end": os.getloadavg(),
               "driver": "python bench/repro/engine_host/start_times.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
