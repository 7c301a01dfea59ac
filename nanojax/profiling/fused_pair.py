"""Times the fused GEMM + decode-attention launch (pallas_kernels/fused_gemm_attention_mgpu.py)
against its parts and against the two back to back, over the GEMM share G; the record
(layout: pair_record.py) is what search/pair.py reads. Called by bench/kernels/fused_pair.py
(the 8B nano-batch shapes, flags) and by `nanojax profile --pair-shares` (the profiled
model's nano-batch shapes, into the profile's "pair").

For each GEMM and each G of the N programs (one per SM), a row of "shares" with:
  gemm       the fused kernel's GEMM body alone on G programs (gemm_part)
  attention  the swap-AB attention alone on N - G programs, 3 workers a program (the
             fused kernel's attention body; measured once per G, the same in each GEMM)
  pair       the fused pair in one launch, GEMM on programs [0, G)
(a share that fails records {"G", "error"}) and once per GEMM at the full grid:
  xla_gemm, gemm_part_full (the GEMM body on N programs), back_to_back (XLA's GEMM then
  the full-grid attention, in one jitted function).

Times: nanojax.profiling.timing.device_seconds (iters calls in one jitted loop, median of
reps). SM clock, power and throttle reasons: nvidia-smi sampled while each case runs for
power_seconds (its own loop, after the timing; pair_record.PowerSampler).
"""
from __future__ import annotations

import dataclasses
import json
import time

from nanojax.profiling.pair_record import (GEMMS, HEAD_DIM, KV_HEADS, Q_HEADS, PowerSampler,
                                           add_share, case, error_row, gemm_entry, header,
                                           share_row)


@dataclasses.dataclass
class PairSpec:
    """The shapes and timing of one pair measurement."""
    shares: list[int]                        # GEMM programs G to measure
    gemms: dict[str, tuple[int, int]] = dataclasses.field(
        default_factory=lambda: dict(GEMMS))  # name -> (K, N)
    tokens: int = 1024                       # GEMM rows (a nano-batch's tokens)
    batch: int = 512                         # decode sequences
    ctx: int = 1024                          # keys per sequence
    heads: tuple[int, int] = (Q_HEADS, KV_HEADS)
    head_dim: int = HEAD_DIM
    page_size: int = 16
    iters: int = 20
    reps: int = 5
    power_seconds: float = 2.0
    sample_ms: int = 50
    gpu_index: int = 0
    programs: int | None = None              # N (None: the SM count)


def model_spec(cfg, tokens: int, batch: int, ctx: int, shares, **timing) -> PairSpec:
    """A model's GEMM nano-ops (one shard's shape) as the pair's GEMMs: qkv, o, gate_up,
    down, at `tokens` rows, beside decode attention of `batch` sequences of `ctx` keys."""
    h, q, kv, ffn = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    gemms = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * ffn), "down": (ffn, h)}
    return PairSpec(shares=list(shares), gemms=gemms, tokens=tokens, batch=batch, ctx=ctx,
                    heads=(cfg.num_heads, cfg.num_kv_heads), head_dim=cfg.head_dim,
                    **timing)


def unavailable() -> str | None:
    """Why the pair cannot be measured here (None: it can)."""
    from pallas_kernels.mosaic_gpu_support import on_hopper
    if not on_hopper():
        import jax
        return (f"no Hopper GPU ({jax.default_backend()}): the fused kernel is Mosaic GPU "
                "(sm_90)")
    return None


def sustained(fn, args, seconds: float, sampler: PowerSampler | None):
    """Run fn over and over for `seconds` (a jitted loop of calls, compiled first) while
    the sampler records; its summary."""
    import jax
    from jax import lax
    if sampler is None or seconds <= 0:
        return None

    @jax.jit
    def loop(a):
        def body(i, carry):
            x, _ = lax.optimization_barrier(carry)
            return x, fn(*x)
        zeros = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                                       jax.eval_shape(fn, *a))
        return lax.fori_loop(0, 20, body, (a, zeros))[1]

    jax.block_until_ready(loop(args))
    sampler.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready(loop(args))
    return sampler.stop()


def measure_pair(spec: PairSpec, command: str, out: str | None = None,
                 log=lambda s: print(s, flush=True), saved=None) -> dict:
    """The pair record at spec's shapes. After each GEMM's timed cases, and again after
    its correctness check, the record so far ("partial": true) is written to `out` and
    handed to saved(record), when given: a run cut short keeps its rows (on the H200 one
    profile sat in a check until its limit: bench/results/log/step.md)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nanojax.profiling.timing import device_seconds
    from pallas_kernels import decode_attention_swapab as swapab
    from pallas_kernels import fused_gemm_attention_mgpu as fused
    from pallas_kernels.device import device_sms
    dev = jax.devices()[0]
    n_prog = spec.programs or device_sms(dev)
    (qh, kvh), d, ps = spec.heads, spec.head_dim, spec.page_size
    sampler = (PowerSampler(spec.gpu_index, spec.sample_ms) if spec.power_seconds > 0
               else None)
    start, say = time.perf_counter(), log

    # stamped here: a pipe's buffering once lost the times (bench/results/log/step.md)
    def log(line):
        say(f"{time.perf_counter() - start:6.1f} s {line}")

    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    n_pages = spec.batch * -(-spec.ctx // ps)
    q = jax.random.normal(ks[0], (spec.batch, qh, d), jnp.bfloat16)
    k_pages = jax.random.normal(ks[1], (n_pages, kvh, ps, d), jnp.bfloat16)
    v_pages = jax.random.normal(ks[2], (n_pages, kvh, ps, d), jnp.bfloat16)
    page_table = jax.random.permutation(ks[3], n_pages).reshape(spec.batch, -1).astype(
        jnp.int32)
    lens = jnp.full((spec.batch,), spec.ctx, jnp.int32)
    att = (q, k_pages, v_pages, page_table, lens)

    def measure(name, fn, fargs):
        t = device_seconds(fn, *fargs, iters=spec.iters, reps=spec.reps)
        log(f"{name:>40s} {t * 1e3:8.3f} ms")
        return case(name, t * 1e3, sustained(fn, fargs, spec.power_seconds, sampler))

    def rel_error(a, b, g):
        c, o = fused.fused_gemm_attention(a, b, *att, gemm_programs=g, num_programs=n_prog)
        ref_c = np.asarray(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
        ref_o = np.asarray(swapab.decode_attention_swapab(*att, num_programs=n_prog),
                           np.float32)
        return {"G": g,
                "gemm": float(np.linalg.norm(np.asarray(c, np.float32) - ref_c)
                              / np.linalg.norm(ref_c)),
                "attention_vs_swapab": float(np.linalg.norm(np.asarray(o, np.float32) - ref_o)
                                             / np.linalg.norm(ref_o))}

    result = header("nanojax fused launch", command, str(dev), n_prog, spec, page_size=ps,
                    attention_workers_fused=fused.WARPGROUPS,
                    kv_layout=f"pages of {ps} keys, page table a random permutation")
    def save(partial=True):
        result["partial"] = partial
        if out is not None:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
        if saved is not None:
            saved(dict(result))

    result["attention_full"] = measure("attention_full", lambda *x: (
        swapab.decode_attention_swapab(*x, num_programs=n_prog)), att)
    att_alone = {}  # the attention alone on N - G programs is the same beside every GEMM
    for name, (kdim, ndim) in spec.gemms.items():
        ka, kb = jax.random.split(jax.random.PRNGKey(1))
        a = jax.random.normal(ka, (spec.tokens, kdim), jnp.bfloat16)
        b = jax.random.normal(kb, (kdim, ndim), jnp.bfloat16) * kdim ** -0.5
        xla = measure(f"{name} xla_gemm", jnp.dot, (a, b))
        part = measure(f"{name} gemm_part_full", lambda x, y: fused.gemm_part(
            x, y, num_programs=n_prog), (a, b))
        b2b = measure(f"{name} back_to_back", lambda x, y, *r: (
            jnp.dot(x, y), swapab.decode_attention_swapab(*r, num_programs=n_prog)),
            (a, b, *att))
        entry = result["gemms"][name] = gemm_entry(
            name, b2b, shape=(kdim, ndim), xla_gemm=xla, gemm_part_full=part,
            gemm_part_full_over_xla=part["ms"] / xla["ms"])
        for g in spec.shares:
            try:  # one share that fails to compile or run leaves the others measured
                gemm_g = measure(f"{name} gemm G={g}", lambda x, y, g=g: fused.gemm_part(
                    x, y, num_programs=g), (a, b))
                if g not in att_alone:
                    att_alone[g] = measure(f"attention {n_prog - g}", lambda *x, g=g: (
                        swapab.decode_attention_swapab(*x, num_programs=n_prog - g,
                                                       warpgroups=fused.WARPGROUPS)), att)
                pair = measure(f"{name} fused G={g}", lambda *x, g=g: (
                    fused.fused_gemm_attention(*x, gemm_programs=g, num_programs=n_prog)),
                    (a, b, *att))
                add_share(entry, share_row(g, g, n_prog - g, gemm_g, att_alone[g], pair,
                                           b2b))
            except Exception as e:  # noqa: BLE001  (recorded in the JSON)
                log(f"{name} G={g}: {e!r}"[:300])
                add_share(entry, error_row(g, e))
        save()
        # checked once per GEMM at its best share, so a wrong kernel cannot pass as a fast one
        entry["fused_rel_error"] = ({"error": "no share ran"} if entry["best_G"] is None
                                    else rel_error(a, b, entry["best_G"]))
        log(f"{name} check {entry['fused_rel_error']}")
        save()
    save(partial=False)
    return result
