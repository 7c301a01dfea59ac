"""Stage II (resource shares) against brute force, its constraints, and the profiler."""
import itertools

import pytest

from nanojax.pipeline.plan import OP_GROUPS
from search.milp import Profile, SearchError, stage1, to_plan
from search.shares import _duration, _levels, stage2

RES = {"qkv": "compute", "attention": "memory", "o_proj": "compute", "mlp": "compute"}


def _profile(interference=None):
    b, g = 64, 32
    per = {"qkv": 1.0, "attention": 2.0, "o_proj": 0.5, "mlp": 3.0}
    times = {j: {n: per[j] * n for n in (32, 64)} for j in OP_GROUPS}
    # the decode kernel at half the GPU is only 20% slower than at all of it
    share_times = {"attention": {0.5: {n: 1.2 * times["attention"][n] for n in (32, 64)},
                                 1.0: dict(times["attention"])}}
    return Profile(b, g, RES, times, None, share_times, interference or {})


def _brute(profile, sched):
    """Every share assignment; for each pair of ops that may not run together (shares
    over 1, not ordered already) both orders; earliest starts along the longest path."""
    ops = sorted(sched["start"], key=lambda o: (sched["start"][o], o))
    size = {o: _span(sched, o[1]) for o in ops}
    prev = {"attention": "qkv", "o_proj": "attention", "mlp": "o_proj"}
    fixed = set()
    for o in ops:
        if o[0] in prev:
            fixed.add(((prev[o[0]], o[1]), o))
    for res in set(RES.values()):
        seq = [o for o in ops if RES[o[0]] == res]
        fixed |= set(zip(seq, seq[1:]))
    best = float("inf")
    for shares in itertools.product(*[_levels(profile, o[0]) for o in ops]):
        share = dict(zip(ops, shares))
        dur = {o: _duration(profile, o[0], size[o], share[o]) for o in ops}
        clash = [(a, b) for i, a in enumerate(ops) for b in ops[i + 1:]
                 if RES[a[0]] != RES[b[0]] and share[a] + share[b] > 1 + 1e-9]
        for orient in itertools.product((0, 1), repeat=len(clash)):
            edges = set(fixed) | {(a, b) if d == 0 else (b, a)
                                  for (a, b), d in zip(clash, orient)}
            finish, left = {}, set(ops)
            while left:  # longest path; a cycle leaves ops that never become ready
                ready = [o for o in left if all(p in finish for p, q in edges if q == o)]
                if not ready:
                    break
                for o in ready:
                    start = max([finish[p] for p, q in edges if q == o], default=0.0)
                    finish[o] = start + dur[o]
                    left.discard(o)
            if not left:
                best = min(best, max(finish.values()))
    return best


def _span(sched, b):
    """Tokens [a, b) of nano-batch b."""
    a = sum(sched["sizes"][:b])
    return a, a + sched["sizes"][b]


@pytest.mark.parametrize("interference", [None, {0.5: (0.6, 0.9)}])
def test_stage2_matches_brute_force_and_keeps_its_constraints(interference):
    prof = _profile(interference)
    sched = stage1(prof, 2, time_limit=30)
    out = stage2(prof, sched, time_limit=30)
    assert out["makespan"] == pytest.approx(_brute(prof, sched), rel=1e-6)
    ops = list(out["start"])
    for o in ops:  # durations follow the chosen share
        assert out["duration"][o] == pytest.approx(
            _duration(prof, o[0], _span(sched, o[1]), out["share"][o]))
    for i, a in enumerate(ops):  # ops that run together share at most the whole GPU
        for b in ops[i + 1:]:
            sa, ea = out["start"][a], out["start"][a] + out["duration"][a]
            sb, eb = out["start"][b], out["start"][b] + out["duration"][b]
            if min(ea, eb) - max(sa, sb) > 1e-6:
                assert RES[a[0]] != RES[b[0]]
                assert out["share"][a] + out["share"][b] <= 1 + 1e-9
    # the cheap half-GPU attention makes overlap pay: some nano-op runs at share 0.5
    assert 0.5 in out["share"].values()
    plan = to_plan(prof, out, {"num_layers": 1})
    assert {(op["op"], op["batch"]): op["share"] for op in plan["nano_ops"]} == out["share"]


def test_profile_with_bad_share_data_is_refused():
    d = {"b_dense": 64, "granularity": 32,
         "ops": {j: {"resource": RES[j], "times": {"32": 1, "64": 2}} for j in OP_GROUPS}}
    d["ops"]["attention"]["times_by_share"] = {"1.5": {"32": 1, "64": 2}}
    with pytest.raises(SearchError, match="share 1.5"):
        Profile.from_dict(d)
    d["ops"]["attention"]["times_by_share"] = {"0.5": {"32": 1}}
    with pytest.raises(SearchError, match="lacks sizes"):
        Profile.from_dict(d)


def test_profiler_writes_a_profile_the_search_reads(tmp_path):
    """On the CPU: real op times of a tiny model, no interference table (one stream), the
    fused pair skipped with its reason (no Hopper GPU)."""
    import json

    from checkpoints.loader import load_model
    from search.milp import search
    from search.profiler import run_profile
    kept = []  # the op profile is handed out before the pair runs (minutes on a GPU)
    prof = run_profile(load_model("random:tiny"), 32, 16, workload="24/16", shares=(0.5,),
                       iters=2, progress=False, num_pages=256, pair_shares=(66,),
                       checkpoint=kept.append)
    assert len(kept) == 1 and kept[0]["ops"] == prof["ops"]
    assert kept[0]["pair"]["measured"] is False and "ended" in kept[0]["pair"]["reason"]
    assert prof["interference"]["measured"] is False
    assert prof["pair"] == {"measured": False, "reason": prof["pair"]["reason"]}
    assert "no Hopper GPU" in prof["pair"]["reason"]
    assert set(prof["ops"]["attention"]["times_by_share"]) == {"0.5", "1.0"}
    mix = prof["ops"]["attention"]["decodes_and_prefill_tokens"]
    assert mix[16][0] > 0 and mix[16][1] > 0 and sum(mix[32]) == 32  # decodes + prefill
    assert all(t > 0 for op in prof["ops"].values() for t in op["times"].values())
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    p = Profile.load(path)
    assert p.prefix == {"attention"}  # the first n tokens of one dense batch
    out = stage2(p, search(p, max_k=2, time_limit=20), time_limit=20)
    assert out["makespan"] > 0


def test_the_profile_times_attention_on_fp8_pages_where_asked():
    """--kv-cache-dtype fp8: the attention op reads an FP8 cache (QuantizedKV, the engine's
    layout), and the profile records the pages' type."""
    import jax.numpy as jnp

    from checkpoints.loader import load_model
    from nanojax.layers.kv_fp8 import QuantizedKV
    from search.profiler import LayerOps, run_profile
    bundle = load_model("random:tiny")
    lay = LayerOps(bundle, 32, 16, "24/16", num_pages=256, kv_cache_dtype="fp8")
    kv = lay.inputs("attention", 16)[3]
    assert isinstance(kv, QuantizedKV) and kv.k_pages.dtype == jnp.float8_e4m3fn
    prof = run_profile(bundle, 32, 16, workload="24/16", shares=(1.0,), iters=2,
                       progress=False, num_pages=256, kv_cache_dtype="fp8")
    assert prof["kv_cache_dtype"] == "float8_e4m3fn" and prof["quantization"] is None
    assert all(t > 0 for t in prof["ops"]["attention"]["times"].values())


def test_profile_cli_runs_without_the_kv_flag(tmp_path):
    """`nanojax profile` with no --kv-cache-dtype (the flag's unset value is no attribute
    at all): the model's pages, recorded."""
    import json

    from nanojax.cli import main
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "random:tiny", "--b-dense", "32", "--granularity", "16",
                 "--workload", "24/16", "--iters", "1", "--shares", "1.0",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["kv_cache_dtype"] == "float32"


def test_the_profiled_pair_takes_the_models_nano_batch_shapes():
    """A GEMM of half the dense batch (each of the model's GEMM nano-ops), beside half the
    dense batch's decodes at their mean context (rounded up to whole pages)."""
    import numpy as np

    from checkpoints.loader import load_model
    from search.profiler import LayerOps, pair_spec
    bundle = load_model("random:tiny")
    cfg = bundle.config
    lay = LayerOps(bundle, 32, 16, "24/16", num_pages=256)
    spec = pair_spec(lay, 32, 16, [44, 88], power_seconds=0)
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    assert spec.gemms == {"qkv": (h, cfg.q_size + 2 * cfg.kv_size), "o": (cfg.q_size, h),
                          "gate_up": (h, 2 * ffn), "down": (ffn, h)}
    assert spec.tokens == 16 and spec.shares == [44, 88] and spec.power_seconds == 0
    d = lay.dense.num_decodes
    assert d > 0 and spec.batch == max(1, d // 2)
    mean = float(np.mean(np.asarray(lay.dense.meta.positions)[:d] + 1))
    assert spec.ctx % lay.page_size == 0 and mean <= spec.ctx < mean + lay.page_size
    assert spec.heads == (cfg.num_heads, cfg.num_kv_heads) and spec.head_dim == cfg.head_dim
    some = pair_spec(lay, 32, 16, [44], gemms=["gate_up", "qkv"])  # --pair-gemms
    assert some.gemms == {"gate_up": (h, 2 * ffn), "qkv": spec.gemms["qkv"]}


def test_a_failing_pair_leaves_the_profile_with_its_reason(monkeypatch):
    """The pair runs last: if it fails, the minutes of op profile are kept and the pair says
    why, which the search reads as 'plan no overlap'."""
    from checkpoints.loader import load_model
    from nanojax.profiling import fused_pair
    from search.profiler import LayerOps, measure_pair_or_skip
    lay = LayerOps(load_model("random:tiny"), 32, 16, "24/16", num_pages=256)

    def broken(spec, command, log=None, saved=None):
        if saved:  # what a pair that stalls after its first GEMM leaves
            saved({"gemms": {"gate_up": {"shares": [{"G": 66}]}}, "partial": True})
        raise RuntimeError("Mosaic GPU lowering failed")
    monkeypatch.setattr(fused_pair, "unavailable", lambda: None)
    monkeypatch.setattr(fused_pair, "measure_pair", broken)
    logged = []
    out = measure_pair_or_skip(lay, 32, 16, [66], power_seconds=0, log=logged.append)
    assert out == {"measured": False,
                   "reason": "the pair failed: RuntimeError: Mosaic GPU lowering failed"}
    assert logged and "the pair failed" in logged[0]
    # handed out as it goes: run_profile writes it into the profile on disk
    kept = []
    measure_pair_or_skip(lay, 32, 16, [66], power_seconds=0, log=logged.append,
                         saved=kept.append)
    assert kept == [{"gemms": {"gate_up": {"shares": [{"G": 66}]}}, "partial": True}]
