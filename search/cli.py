"""`nanojax costmodel` (and, later, `profile` and `search`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from nanojax.config import QUANTIZATIONS
from nanojax.config_flags import add_engine_args, kernel_config_from_args


def cmd_costmodel(args) -> int:
    from nanojax.config import named_shape
    from search.costmodel import WORKLOADS, analyze, gpu_from, table
    if args.table:
        rows = table(batch=args.batch, workload=args.workload or "splitwise")
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"{'model':<12}{'gpu':<18}{'tp':>3}{'TR':>8}{'Tnet/Tc':>9}  bound    "
                  f"{'optimal tok/s/GPU':>18}")
            for r in rows:
                print(f"{r['model']:<12}{r['gpu']:<18}{r['tp']:>3}{r['TR']:>8.3f}"
                      f"{r['T_net_over_T_compute']:>9.3f}  {r['bound']:<8}"
                      f"{r['optimal_tokens_per_s_per_gpu']:>18.0f}")
        return 0
    p, d = WORKLOADS[args.workload] if args.workload else (args.prompt_len, args.output_len)
    gpu = gpu_from(args.gpu, args.tflops, args.mem_bw, args.net_bw)
    res = analyze(gpu, named_shape(args.model), args.batch, args.tp, p, d,
                  nano_batch=args.nano_batch)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:<30} {v}")
    if args.plot:
        plot_tr(gpu, named_shape(args.model), args.tp, p, d, args.plot)
        print(f"nanojax: wrote {args.plot}", file=sys.stderr)
    return 0


def plot_tr(gpu, cfg, tp, p, d, path) -> None:
    """TR and T_net/T_compute against batch size, like the paper's Figures 2-3."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from search.costmodel import analyze
    batches = [2 ** i for i in range(2, 14)]
    rows = [analyze(gpu, cfg, b, tp, p, d) for b in batches]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["TR"] for r in rows], "o-", label="T_mem / T_compute")
    if tp > 1:
        ax.plot(batches, [r["T_net_over_T_compute"] for r in rows], "s-",
                label="T_net / T_compute")
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("dense batch (tokens)")
    ax.set_ylabel("ratio to T_compute")
    ax.set_title(f"{gpu.name}, TP {tp}, prompt {p} / output {d}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_search(args) -> int:
    from tqdm.auto import tqdm

    from nanojax.config import named_shape
    from search.milp import Profile, SearchError, search, stage1, to_plan
    report = {}
    pair = _read_pair(args.pair) if args.pair else None
    if args.profile:
        try:
            raw = json.loads(Path(args.profile).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SearchError(f"cannot read profile {args.profile}: {e}") from None
        # the pair that `nanojax profile --pair-shares` measured, unless --pair names one
        if pair is None and isinstance(raw, dict) and _is_pair(raw.get("pair")):
            pair = raw["pair"]
            report["pair_source"] = f"{args.profile} (its 'pair')"
        elif pair is not None:
            report["pair_source"] = args.pair
        prof = Profile.from_dict(raw if pair is None else _with_pair(raw, pair))
    elif args.datasheet:  # a profile synthesized from the cost model and a datasheet
        from search.costmodel import WORKLOADS, analyze, gpu_from
        from search.datasheet import datasheet_profile
        if args.workload not in WORKLOADS:
            raise SystemExit(f"nanojax: --workload must be one of {sorted(WORKLOADS)}")
        cfg, gpu = named_shape(args.model), gpu_from(args.datasheet)
        p, d = WORKLOADS[args.workload]
        raw = datasheet_profile(gpu, cfg, args.tp, args.b_dense, args.granularity, p, d)
        prof = Profile.from_dict(raw if pair is None else _with_pair(raw, pair))
        a = analyze(gpu, cfg, args.b_dense, args.tp, p, d)
        report["cost_model"] = {k: a[k] for k in ("bound", "TR", "T_net_over_T_compute",
                                                  "T_compute_s", "T_mem_s", "T_net_s")}
        report["profile_source"] = raw["source"]
    else:
        raise SystemExit("nanojax: give --profile FILE or --datasheet GPU")
    signature = prof.model or named_shape(args.model).signature()
    with tqdm(total=args.max_k, desc="stage I", unit="split") as bar:
        def progress(k, s):
            bar.update(1)
            bar.set_postfix(k=k, makespan=f"{s['makespan']:.4g}")
        best = search(prof, max_k=args.max_k, time_limit=args.time_limit, progress=progress)
    if not prof.concurrent:
        print("nanojax: the profile's GEMM + attention pair never ran together on this "
              "device: planning without overlap", file=sys.stderr)
    elif prof.share_times or prof.interference:  # stage II: resource shares
        from search.shares import stage2
        best = stage2(prof, best, time_limit=args.time_limit)
        shared = {f"{j}[{b}]": r for (j, b), r in best["share"].items() if r < 1}
        print(f"nanojax: stage II shares below 1: {shared or 'none'}", file=sys.stderr)
    from search.datasheet import non_overlap_time
    serial = non_overlap_time(prof)
    report["overlap"] = _overlap_decision(prof, best, serial, pair)
    if args.overlap == "always" and not report["overlap"]["chosen"]:
        if not prof.concurrent:
            raise SearchError("--overlap always: the profile's GEMM + attention pair never "
                              "ran together on this device, so there is no overlap to plan")
        declined = report["overlap"]["reason"]
        if len(best["sizes"]) == 1:  # stage I stopped at one: the best split there is
            best = _best_split(prof, args.max_k, args.time_limit)
        report["overlap"].update(chosen=True, forced=True, reason=(
            f"--overlap always; the search would plan none: {declined}"),
            predicted_gain=serial / best["makespan"])
        print(f"nanojax: overlap kept by --overlap always (declined: {declined})",
              file=sys.stderr)
    # (a profile whose pair never ran together is already planned with nothing overlapped)
    if not report["overlap"]["chosen"] and prof.concurrent and len(best["sizes"]) > 1:
        print(f"nanojax: no overlap: {report['overlap']['reason']}", file=sys.stderr)
        best = stage1(prof, 1, args.time_limit)  # one nano-batch: every op on one stream
    plan = to_plan(prof, best, signature, args.tp)
    if pair is not None and report["overlap"]["chosen"] and len(best["sizes"]) > 1:
        from search.pair import fuse  # the overlapped pairs as the launch that was measured
        plan, report["overlap"]["fused_pairs"] = fuse(plan, best, pair)
        fused = [f"{e['gemm']}+attention[{e['attention']}] G {e['gemm_programs']}"
                 for e in report["overlap"]["fused_pairs"] if "gemm" in e]
        print(f"nanojax: fused pairs: {', '.join(fused) or 'none'}", file=sys.stderr)
    report.update({"nano_batches": best["sizes"], "predicted_makespan_s": best["makespan"],
                   "non_overlap_s": serial,
                   "predicted_gain_over_non_overlap": serial / best["makespan"]})
    plan["predicted"]["report"] = report
    Path(args.out).write_text(json.dumps(plan, indent=1))
    print(f"nanojax: {best['k']} nano-batches {best['sizes']}, predicted makespan "
          f"{best['makespan']:.4g} s per layer against {serial:.4g} s without overlap "
          f"({serial / best['makespan']:.3f}x); wrote {args.out}", file=sys.stderr)
    print(json.dumps(report))
    if args.png:
        plot_plan(plan, prof, args.png)
        print(f"nanojax: wrote {args.png}", file=sys.stderr)
    return 0


def _best_split(prof, max_k: int, time_limit: float) -> dict:
    """The best schedule of 2..max_k nano-batches (with stage II's shares where the
    profile has them), for --overlap always where the search kept one."""
    from search.milp import SearchError, stage1
    ks = range(2, min(max_k, prof.b_dense // prof.granularity) + 1)
    if not ks:
        raise SearchError(f"--overlap always needs two or more nano-batches: --max-k is "
                          f"{max_k} and B_dense {prof.b_dense} holds "
                          f"{prof.b_dense // prof.granularity} of {prof.granularity}")
    best = min((stage1(prof, k, time_limit) for k in ks), key=lambda s: s["makespan"])
    if prof.share_times or prof.interference:
        from search.shares import stage2
        best = stage2(prof, best, time_limit=time_limit)
    return best


def _read_json(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"nanojax: cannot read {path}: {e}") from None


def _is_pair(record) -> bool:
    return isinstance(record, dict) and "programs" in record and "gemms" in record


def _read_pair(path) -> dict:
    record = _read_json(path)
    if not _is_pair(record):
        raise SystemExit(f"nanojax: {path} is not a pair file written by "
                         "bench/kernels/fused_pair.py (no 'programs' or 'gemms')")
    return record


def _with_pair(profile: dict, pair: dict) -> dict:
    """The profile with its interference table measured on the fused pair."""
    from search.pair import interference_from_pair
    shares = [float(r) for r in
              profile.get("ops", {}).get("attention", {}).get("times_by_share", {})]
    return {**profile, "interference": interference_from_pair(pair, shares or [0.5])}


def _overlap_decision(prof, best: dict, serial: float, pair: dict | None) -> dict:
    """Overlap only where the plan is predicted to beat one nano-batch with every op in
    turn, and, when a measured pair is given, where that pair beat back to back."""
    predicted = serial / best["makespan"]
    out = {"chosen": True, "predicted_gain": predicted, "reason": ""}
    if pair is not None:
        from search.pair import best_gain
        gain = best_gain(pair)
        out["pair_best_gain_over_back_to_back"] = gain
        if gain is None:
            out["pair_unread"] = ("no GEMM of the pair file passed its correctness check "
                                  "(search/pair.py, checked_gemms): its times were not read")
        if gain is not None and gain < 1:
            out.update(chosen=False, reason=(
                f"the measured GEMM + attention pair is at best {gain:.3f}x back to back "
                f"(every GEMM and share measured on {pair.get('device', 'the device')}): "
                f"overlapping cannot pay"))
            return out
    if not prof.concurrent:
        out.update(chosen=False, reason="the profiled pair never ran together")
    elif predicted <= 1 + 1e-6:
        out.update(chosen=False, reason=f"predicted {predicted:.3f}x of no overlap")
    return out


def cmd_profile(args) -> int:
    from nanojax.plugins import model_loader
    from search.milp import SearchError
    from search.profiler import check_pair_pages, run_profile
    try:
        shares = [float(x) for x in args.shares.split(",")]
    except ValueError:
        shares = [-1.0]
    if any(not 0 < r <= 1 for r in shares):
        raise SystemExit(f"nanojax: --shares must be numbers in (0, 1], got {args.shares}")
    if args.granularity <= 0 or args.b_dense <= 0 or args.b_dense % args.granularity:
        raise SystemExit(f"nanojax: --b-dense ({args.b_dense}) must be a positive multiple "
                         f"of --granularity ({args.granularity})")
    try:
        pair_shares = [int(g) for g in args.pair_shares.split(",")] if args.pair_shares else []
    except ValueError:
        pair_shares = [-1]
    if any(g <= 0 for g in pair_shares):
        raise SystemExit(f"nanojax: --pair-shares must be positive integers (GEMM programs "
                         f"G of the fused pair), got {args.pair_shares}")
    from nanojax.profiling.pair_record import GEMMS
    bad = sorted(set(args.pair_gemms.split(",") if args.pair_gemms else ()) - set(GEMMS))
    if bad:
        raise SystemExit(f"nanojax: --pair-gemms: unknown {bad}; choose from {list(GEMMS)}")
    from nanojax.profiling.synthetic import workload_lengths
    workload_lengths(args.workload, 2048)  # a bad workload fails before the profile runs
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")  # an unset flag: no attribute
    try:
        check_pair_pages(pair_shares, kv_cache_dtype)
    except SearchError as e:
        raise SystemExit(f"nanojax: {e}") from None
    if args.tp > 1 and args.model.startswith("random:"):
        # only one shard's shape is profiled (random weights): never load the whole model
        from nanojax.config import named_shape
        from nanojax.models.bundle import ModelBundle, default_dtype
        bundle = ModelBundle(named_shape(args.model.split(":", 1)[1],
                                         args.dtype or default_dtype()).replace(
            quantization=args.quantization), None, None)
    else:
        bundle = model_loader().load_model(args.model, dtype=args.dtype,
                                           cache_dir=args.cache_dir,
                                           quantization=args.quantization)
    command = " ".join(["nanojax"] + sys.argv[1:])

    def write(prof):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**prof, "command": command}, indent=1))
        print(f"nanojax: wrote {args.out}", file=sys.stderr)
    pair_gemms = args.pair_gemms.split(",") if args.pair_gemms else None
    try:
        prof = run_profile(bundle, args.b_dense, args.granularity, args.workload, shares,
                           iters=args.iters, tp=args.tp,
                           kernels=kernel_config_from_args(args), pair_shares=pair_shares,
                           pair_power_seconds=args.pair_power_seconds,
                           pair_gemms=pair_gemms, checkpoint=write,
                           kv_cache_dtype=kv_cache_dtype)
    except SearchError as e:
        raise SystemExit(f"nanojax: {e}") from None
    write(prof)
    return 0


def plot_plan(plan: dict, prof, path) -> None:
    """Predicted nano-ops per resource on a time axis (a Gantt chart)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pred = plan["predicted"]
    lanes = ["compute", "memory", "network"]
    colors = {"qkv": "#4c72b0", "attention": "#dd8452", "o_proj": "#55a868", "mlp": "#c44e52",
              "o_allreduce": "#8172b3", "mlp_allreduce": "#937860"}
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for key, t0 in pred["start_s"].items():
        op, b = key[:-1].split("[")
        lane = lanes.index(prof.resource[op])
        d = pred["duration_s"][key]
        ax.barh(lane, d, left=t0, color=colors[op], edgecolor="black")
        ax.text(t0 + d / 2, lane, f"{op}[{b}]", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("predicted time within one layer")
    ax.set_title(f"plan: {len(plan['nano_batches']['qkv'])} nano-batches, makespan "
                 f"{pred['makespan_s']:.4g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def register(sub) -> None:
    c = sub.add_parser("costmodel", help="compute/memory/network-bound analysis (NanoFlow)")
    c.add_argument("--gpu", default="a100", help="v100, a100, h100, h200, b200, h200-measured")
    c.add_argument("--model", default="llama2-70b", help="a named shape (e.g. llama3-8b)")
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--batch", type=int, default=2048)
    c.add_argument("--workload", default=None,
                   help="splitwise, lmsys, sharegpt, constant-512-512, ...")
    c.add_argument("--prompt-len", type=float, default=512)
    c.add_argument("--output-len", type=float, default=512)
    c.add_argument("--nano-batch", type=int, default=None,
                   help="MoE models: tokens per MLP nano-batch (expert GEMM efficiency)")
    c.add_argument("--tflops", type=float, default=None, help="override: measured TFLOP/s")
    c.add_argument("--mem-bw", type=float, default=None, help="override: measured TB/s")
    c.add_argument("--net-bw", type=float, default=None, help="override: GB/s per GPU")
    c.add_argument("--table", action="store_true", help="the Table-2-like overview")
    c.add_argument("--plot", default=None, help="write a PNG of TR against batch")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_costmodel)

    s = sub.add_parser("search", help="two-stage MILP (sizes and order, then resource "
                                      "shares) -> plan")
    s.add_argument("--profile", default=None, help="profile JSON (see search/milp.py)")
    s.add_argument("--datasheet", default=None, metavar="GPU",
                   help="instead of --profile: synthesize one from the cost model and this "
                        "GPU's datasheet (search/datasheet.py), for --model at --tp")
    s.add_argument("--workload", default="splitwise", help="with --datasheet: "
                   "splitwise, lmsys, sharegpt, constant-512-512, ...")
    s.add_argument("--b-dense", type=int, default=2048, help="with --datasheet")
    s.add_argument("--granularity", type=int, default=128, help="with --datasheet")
    s.add_argument("--out", required=True, help="plan JSON to write")
    s.add_argument("--model", default="llama3-8b",
                   help="model signature when the profile names none")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--max-k", type=int, default=4)
    s.add_argument("--time-limit", type=float, default=120.0, help="seconds per MILP")
    s.add_argument("--png", default=None, help="write the predicted schedule as a PNG")
    s.add_argument("--overlap", choices=("auto", "always"), default="auto",
                   help="auto: overlap only where the measured pair beat back to back and "
                        "the plan is predicted to beat no overlap; always: keep the "
                        "searched overlapped schedule even so (to time what the search "
                        "declined; the plan's report says it was forced)")
    s.add_argument("--pair", default=None, metavar="FILE",
                   help="a measured GEMM + attention pair (bench/kernels/fused_pair.py's "
                        "JSON; default: the profile's own 'pair', from nanojax profile "
                        "--pair-shares): stage II reads its interference, the plan has no "
                        "overlap where the pair does not beat back to back, and else fuses "
                        "each overlapped GEMM + attention pair into one launch")
    s.set_defaults(func=cmd_search)

    pr = sub.add_parser("profile", help="measure op times by batch size and share, and the "
                                        "interference table (GPU) -> profile JSON")
    pr.add_argument("--model", default="random:llama3-8b")
    pr.add_argument("--dtype", default=None)
    pr.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="fp8 / fp8-block: profile the FP8 projections (W8A8, "
                         "nanojax/layers/fp8.py)")
    pr.add_argument("--cache-dir", default=None)
    pr.add_argument("--b-dense", type=int, default=2048)
    pr.add_argument("--granularity", type=int, default=128)
    pr.add_argument("--workload", default="512/512",
                    help="PROMPT/OUTPUT or a trace: attention of n tokens is profiled on a "
                         "steady-state batch of n tokens of this workload")
    pr.add_argument("--shares", default="0.25,0.5,1.0",
                    help="resource shares of the attention kernel to profile")
    pr.add_argument("--iters", type=int, default=10)
    pr.add_argument("--tp", type=int, default=1,
                    help="profile one TP shard's ops and the all-reduces over this many "
                         "devices (the network nano-ops)")
    pr.add_argument("--pair-shares", default="", metavar="G,G,...",
                    help="also time the fused GEMM + attention launch (Hopper) at these GEMM "
                         "program counts G, e.g. 44,66,88,110: each side alone, the pair and "
                         "back to back at the model's nano-batch shapes, clock and power "
                         "sampled; stored as the profile's 'pair', which nanojax search "
                         "reads (skipped with the reason off Hopper)")
    pr.add_argument("--pair-gemms", default="", metavar="NAME,...",
                    help="with --pair-shares: the GEMM nano-ops to pair, of qkv, o, gate_up, "
                         "down (default: all; each compiles its fused launch per G, minutes "
                         "on the H200)")
    pr.add_argument("--pair-power-seconds", type=float, default=1.0,
                    help="with --pair-shares: seconds each case runs while nvidia-smi "
                         "samples clock and power (0: off)")
    pr.add_argument("--out", required=True)
    add_engine_args(pr, kernels_only=True)
    add_engine_args(pr, only=("kv_cache_dtype",))
    pr.set_defaults(func=cmd_profile)
