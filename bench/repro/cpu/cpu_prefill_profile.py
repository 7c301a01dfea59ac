"""Where a CPU prefill's time goes (issue 20 item 4): one ~1,500-token prompt through the
embedded default (`LLM` on SmolLM2-135M, the engine's CPU defaults, one generated token),
profiled once after a warm-up and REPEATS timed runs; every XLA op's time from the trace,
named by the HLO's op_name (XLA_FLAGS dumps the optimized HLO to a temporary directory)
and summed by kind: each projection GEMM, the attention (the ops inside its loops), the
rest; and transformers on the same GGUF (`nanojax bench latency`'s peer) in the same
process, its ops' self times from torch's profiler summed by kind. XLA's CPU runtime runs independent ops on its threads at once (q/k/v, gate/up), so
the op times add up to more than the wall time.
Usage: python bench/repro/cpu/cpu_prefill_profile.py OUT.json [--tokens 1500] [--repeats 3]
       [--no-peer]
"""
import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="nanojax_hlo_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} "
                           "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=run_layer")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from checkpoints.loader import load_model  # noqa: E402
from checkpoints.embedded import cache_dir, smollm2_gguf  # noqa: E402
from nanojax.bench.latency import TransformersPeer  # noqa: E402
from nanojax.engine.llm import LLM  # noqa: E402
from nanojax.engine.sampling import SamplingParams  # noqa: E402
from nanojax.profiling.record import run_record, write_json  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OP_LINE = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*op_name="([^"]+)"')


def op_names() -> dict:
    """(module, HLO op) -> the jax op_name it came from, from the dumped optimized HLO (a
    module compiled for several shapes: its last compile, the prefill's)."""
    names = {}
    for path in sorted(glob.glob(os.path.join(DUMP, "*after_optimizations.txt"))):
        module = os.path.basename(path).split(".")[1]
        for line in open(path):
            m = OP_LINE.match(line)
            if m:
                names[(module, m.group(1))] = m.group(2)
    return names


def kind(op_name: str) -> str:
    if "/while/" in op_name:
        return "attention (inside its loops)"
    for p in PROJECTIONS:
        if f"/{p}/dot_general" in op_name:
            return f"gemm {p}"
    return "other"


def profile_ops(trace_dir: str) -> dict:
    """Summed time (ms) and count of every leaf XLA op in the trace; loops and calls
    (which hold other ops' time) are left out."""
    path = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))[0]
    events = json.load(gzip.open(path))["traceEvents"]
    ops = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        if re.match(r"(while|conditional|call)[.\d]*$", args["hlo_op"]):
            continue
        o = ops[(args.get("hlo_module", ""), args["hlo_op"])]
        o[0] += e["dur"] / 1e3
        o[1] += 1
    return ops


def torch_kind(key: str) -> str:
    if "attention" in key:
        return "attention"
    if key in ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm"):
        return "gemm"
    return "other"


def profile_peer(peer, prompt: list[int]) -> dict:
    """transformers' prefill of prompt (one new token) under torch's profiler: self CPU
    time (ms) by kind and the top ops."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        peer.generate([prompt], 1)
    by_kind = collections.defaultdict(float)
    rows = []
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3
        by_kind[torch_kind(e.key)] += ms
        rows.append({"op": e.key, "ms": round(ms, 2), "count": e.count})
    rows.sort(key=lambda r: -r["ms"])
    return {"op_ms_by_kind": dict(by_kind), "top_ops": rows[:15]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    args = ap.parse_args()
    threads = len(os.sched_getaffinity(0))
    llm = LLM(load_model("smollm2-135m", dtype="float32"))
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    peer = None if args.no_peer else TransformersPeer(smollm2_gguf(cache_dir()), threads)

    def prefill(peer=None):  # fresh ids each time: a repeated prompt would hit our prefix cache
        ids = rng.integers(1000, 49152, size=args.tokens).tolist()
        t0 = time.perf_counter()
        if peer is None:
            llm.generate([ids], sp, use_tqdm=False)
        else:
            peer.generate([ids], 1)
        return time.perf_counter() - t0
    warm = prefill()
    timed, timed_peer = [], []
    for _ in range(args.repeats):  # alternating, so that load from elsewhere hits both alike
        timed.append(prefill())
        if peer is not None:
            timed_peer.append(prefill(peer))
    trace_dir = tempfile.mkdtemp(prefix="nanojax_trace_")
    jax.profiler.start_trace(trace_dir)
    profiled = prefill()
    jax.profiler.stop_trace()
    names = op_names()
    by_kind = collections.defaultdict(float)
    rows = []
    for (module, op), (ms, n) in profile_ops(trace_dir).items():
        name = names.get((module, op), "")
        by_kind[kind(name)] += ms
        rows.append({"op": op, "op_name": name, "ms": round(ms, 2), "count": n})
    rows.sort(key=lambda r: -r["ms"])
    out = {**run_record(), "command": " ".join(["python", *sys.argv]),
           "what": __doc__.split("\n\n")[0], "tokens": args.tokens,
           "threads": threads, "jax": jax.__version__,
           "ttft_s": {"warm_up": warm, "timed": timed, "profiled": profiled},
           "op_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
           "op_ms_total": sum(by_kind.values()), "top_ops": rows[:30]}
    if peer is not None:
        out["peer"] = {"stack": peer.stack, "ttft_s": {"timed": timed_peer},
                       "ours_over_peer_median": float(np.median(timed) / np.median(timed_peer)),
                       **profile_peer(peer, rng.integers(1000, 49152, size=args.tokens).tolist())}
    for k, ms in out["op_ms_by_kind"].items():
        print(f"{k:32s} {ms:8.1f} ms", file=sys.stderr)
    if peer is not None:
        for k, ms in out["peer"]["op_ms_by_kind"].items():
            print(f"transformers {k:19s} {ms:8.1f} ms", file=sys.stderr)
    print(json.dumps({"ttft_s_median": float(np.median(timed)), "op_ms_total": out["op_ms_total"],
                      "ours_over_peer": out.get("peer", {}).get("ours_over_peer_median")}))
    write_json(args.out, out)


if __name__ == "__main__":
    main()
