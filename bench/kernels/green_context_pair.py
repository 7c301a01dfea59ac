"""PyTorch reference for fused_pair.py at its shapes: cuBLAS GEMM (x @ w, bf16) and SDPA
decode attention (enable_gqa) on disjoint SM sets of one GPU, made with CUDA green
contexts (driver API through cuda.bindings, each context's stream handed to PyTorch);
writes one JSON file in fused_pair.py's layout (pair_record.py), so one plot reads both.

    PYTHONPATH=. python3 bench/kernels/green_context_pair.py --out green_context_pair.json

Per GEMM and share G (GEMM SMs; attention gets the rest), a row of "shares" with the GEMM
alone on its green context, the attention alone on its, and the pair concurrently, and
once per GEMM at the full grid: gemm_full and back_to_back (the GEMM then the attention
on the ordinary stream); attention_full once. cuDevSmResourceSplitByCount rounds a group
up to its SM granularity, so the split is made both ways (a group of G for the GEMM, or
of N - G for the attention, the rest to the other) and the one whose GEMM count is nearer
G kept: gemm_sms / attention_sms are the counts the contexts got, split_group the side.
The attention reads contiguous [batch, kv_heads, ctx, D] keys and values, not pages as
nanojax's kernel does.

Times: median over --reps of (--iters calls, then synchronize) / iters by perf_counter.
SM clock and power: pair_record.PowerSampler while each case loops for --power-seconds.
The driver calls are those of ../shared/probes/overlap_green_streams.py (run on the H200).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from nanojax.profiling.pair_record import (GEMMS, HEAD_DIM, KV_HEADS, Q_HEADS,
                                          PowerSampler, add_share, make_parser, case,
                                          check_args, error_row, gemm_entry, header,
                                          share_row)


def parse_args(argv=None):
    p = make_parser(__doc__)
    return check_args(p, p.parse_args(argv))


def require_cuda():
    """(torch, cuda.bindings.driver), or SystemExit naming every missing piece."""
    missing, torch, driver = [], None, None
    try:
        import torch
    except ImportError:
        missing.append("torch is not installed")
    if torch is not None and not torch.cuda.is_available():
        missing.append(f"torch {torch.__version__} sees no CUDA device")
    try:
        from cuda.bindings import driver
    except ImportError:
        missing.append("cuda.bindings is not installed (pip package cuda-bindings: the "
                       "CUDA driver API that makes green contexts)")
    if missing:
        raise SystemExit("green_context_pair.py needs a CUDA GPU, torch and cuda.bindings: "
                         + "; ".join(missing))
    return torch, driver


def ok(r):
    """A driver call's value(s); raises on a CUresult other than CUDA_SUCCESS."""
    err, rest = (r[0], r[1:]) if isinstance(r, tuple) else (r, ())
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


class GreenContexts:
    """Device 0's SMs and streams on green contexts made from parts of them."""

    def __init__(self, torch, cu):
        self.torch, self.cu = torch, cu
        self.dev = ok(cu.cuDeviceGet(0))
        self.sm = ok(cu.cuDeviceGetDevResource(
            self.dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        self.total = int(self.sm.sm.smCount)
        self.keep = []  # contexts live as long as the process: their streams are in use

    def split(self, g: int):
        """(gemm resource, attention resource, which side was the group) with the GEMM's
        count nearest g; ties go to the GEMM's group."""
        if not 0 < g < self.total:
            raise ValueError(f"G={g} leaves no SMs to one side of {self.total}")
        best, errors = None, []
        for side, count in (("gemm", g), ("attention", self.total - g)):
            try:
                groups, _, rest = ok(self.cu.cuDevSmResourceSplitByCount(
                    1, self.sm, 0, count))[:3]
            except RuntimeError as e:
                errors.append(f"{side} group of {count}: {e}")
                continue
            gemm, att = (groups[0], rest) if side == "gemm" else (rest, groups[0])
            dist = abs(int(gemm.sm.smCount) - g)
            if best is None or dist < best[0]:
                best = (dist, gemm, att, side)
        if best is None:
            raise RuntimeError("; ".join(errors))
        return best[1:]

    def stream(self, resource):
        cu = self.cu
        desc = ok(cu.cuDevResourceGenerateDesc([resource], 1))
        ctx = ok(cu.cuGreenCtxCreate(desc, self.dev,
                                     cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        s = ok(cu.cuGreenCtxStreamCreate(ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        self.keep.append(ctx)
        return self.torch.cuda.ExternalStream(int(s))


def main(argv=None):
    args = parse_args(argv)
    torch, cu = require_cuda()
    import torch.nn.functional as F

    dev = torch.device("cuda")
    torch.cuda.init()
    torch.zeros(1, device=dev)  # the primary context, before the green ones
    green = GreenContexts(torch, cu)
    sampler = PowerSampler(args.gpu_index, args.sample_ms) if args.power_seconds > 0 else None

    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)

    q = randn(args.batch, Q_HEADS, 1, HEAD_DIM)
    k = randn(args.batch, KV_HEADS, args.ctx, HEAD_DIM)
    v = randn(args.batch, KV_HEADS, args.ctx, HEAD_DIM)

    def attn():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def on(*work):
        """work: (stream, fn) pairs, each fn launched on its stream, all joined to the
        current stream (so a timing's synchronize waits for them)."""
        def run():
            cur = torch.cuda.current_stream()
            for s, _ in work:
                s.wait_stream(cur)
            for s, fn in work:
                with torch.cuda.stream(s):
                    fn()
            for s, _ in work:
                cur.wait_stream(s)
        return run

    def seconds(fn):
        for _ in range(3):  # warm-up: cuBLAS / SDPA pick their kernels
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) / args.iters)
        return statistics.median(ts)

    def sustained(fn):
        if sampler is None:
            return None
        sampler.start()
        end = time.perf_counter() + args.power_seconds
        while time.perf_counter() < end:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        return sampler.stop()

    def measure(name, fn):
        t = seconds(fn)
        print(f"{name:>40s} {t * 1e3:8.3f} ms", flush=True)
        return case(name, t * 1e3, sustained(fn))

    result = header("torch green contexts", " ".join(["python3"] + sys.argv),
                    torch.cuda.get_device_name(0), green.total, args, torch=torch.__version__,
                    gemm="cuBLAS x @ w, bf16",
                    attention="torch SDPA, enable_gqa=True, bf16 (backend torch's choice)",
                    kv_layout="contiguous [batch, kv_heads, ctx, D]: the peer reads dense "
                              "KV, not pages")

    def write():  # after each step: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["attention_full"] = measure("attention_full", attn)
    gemms = {}
    for name in args.gemms:
        try:
            kdim, ndim = GEMMS[name]
            x = randn(args.tokens, kdim)
            w = randn(kdim, ndim) * kdim ** -0.5

            def gemm(x=x, w=w):
                return x @ w
            full = measure(f"{name} gemm_full", gemm)
            b2b = measure(f"{name} back_to_back", lambda gemm=gemm: (gemm(), attn()))
            result["gemms"][name] = gemm_entry(name, b2b, gemm_full=full)
            gemms[name] = gemm
        except Exception as e:  # noqa: BLE001  (recorded in the JSON)
            print(f"{name}: {e!r}"[:300], flush=True)
            result["gemms"][name] = {"error": repr(e)[:400]}
    write()
    for g in args.shares:
        try:  # the contexts and the attention alone serve every GEMM at this share
            gemm_res, att_res, side = green.split(g)
            sg, sa = green.stream(gemm_res), green.stream(att_res)
            n_g, n_a = int(gemm_res.sm.smCount), int(att_res.sm.smCount)
            att_g = measure(f"attention on {n_a} SMs", on((sa, attn)))
        except Exception as e:  # noqa: BLE001
            print(f"G={g}: {e!r}"[:300], flush=True)
            for name in gemms:
                add_share(result["gemms"][name], error_row(g, e))
            write()
            continue
        for name, gemm in gemms.items():
            entry = result["gemms"][name]
            try:
                gemm_g = measure(f"{name} gemm on {n_g} SMs", on((sg, gemm)))
                pair = measure(f"{name} pair {n_g}+{n_a} SMs", on((sg, gemm), (sa, attn)))
                add_share(entry, share_row(g, n_g, n_a, gemm_g, att_g, pair,
                                           entry["back_to_back"], split_group=side))
            except Exception as e:  # noqa: BLE001
                print(f"{name} G={g}: {e!r}"[:300], flush=True)
                add_share(entry, error_row(g, e))
        write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
