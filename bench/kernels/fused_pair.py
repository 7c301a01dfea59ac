"""GPU benchmark of the fused GEMM + decode-attention kernel (one launch split by program
id, pallas_kernels/fused_gemm_attention_mgpu.py) against its parts and against the two
back to back; writes one JSON file (layout: nanojax/profiling/pair_record.py, shared with
the PyTorch green-context reference green_context_pair.py).

    PYTHONPATH=. python3 bench/kernels/fused_pair.py --out bench/results/fused_pair_h200.json

Both benches and the plot (plot_fused_pair.py) in one GPU call, into $OUT:
`OUT=dir bash bench/repro/overlap_search/fused_pair_gpu.sh`.

At the LLaMA-3-8B nano-batch shapes of B_dense 2048 (a GEMM nano-batch of --tokens 1024
tokens: qkv, o, gate_up or down; a decode nano-batch of --batch 512 sequences of --ctx
1024 keys, 32/8 heads, D 128, pages of 16), for each GEMM and each GEMM share G of the N
programs (one per SM). The timing is nanojax/profiling/fused_pair.py's (its docstring
lists the cases), which `nanojax profile --pair-shares` runs at the profiled model's
shapes. Ratios per row: back_to_back_over_pair (> 1: the fused pair pays),
pair_over_slower_part (1: the two sides do not slow each other); per GEMM
gemm_part_full_over_xla.
"""
from __future__ import annotations

import sys

from nanojax.profiling.pair_record import GEMMS, make_parser, check_args


def parse_args(argv=None):
    p = make_parser(__doc__)
    p.add_argument("--programs", type=int, default=None,
                   help="programs N of the fused kernel (default: the SM count)")
    return check_args(p, p.parse_args(argv))


def main(argv=None):
    args = parse_args(argv)
    from nanojax.profiling.fused_pair import PairSpec, measure_pair
    spec = PairSpec(shares=args.shares, gemms={g: GEMMS[g] for g in args.gemms},
                    tokens=args.tokens, batch=args.batch, ctx=args.ctx, iters=args.iters,
                    reps=args.reps, power_seconds=args.power_seconds,
                    sample_ms=args.sample_ms, gpu_index=args.gpu_index,
                    programs=args.programs)
    measure_pair(spec, " ".join(["python3"] + sys.argv), out=args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
