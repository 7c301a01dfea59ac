"""Stage-I search against brute force on small synthetic profiles."""
import itertools

import pytest

from nanojax.pipeline.plan import OP_GROUPS, check_order, validate
from search.milp import Profile, SearchError, search, stage1, to_plan


def _profile(b, g, per_token, fixed, resource=None):
    resource = resource or {"qkv": "compute", "attention": "memory", "o_proj": "compute",
                            "mlp": "compute"}
    return Profile(b, g, resource, {j: {n: fixed[j] + per_token[j] * n
                                        for n in range(g, b + 1, g)} for j in OP_GROUPS})


def _brute(profile, k):
    """Every split, every dependency-respecting issue order, each op as early as its
    resource and predecessor allow (semi-active schedules contain an optimum)."""
    g, units = profile.granularity, profile.b_dense // profile.granularity
    best = float("inf")
    for split in itertools.product(range(1, units + 1), repeat=k):
        if sum(split) != units:
            continue
        ops = [(j, b) for b in range(k) for j in OP_GROUPS]
        ends = [g * sum(split[:b + 1]) for b in range(k)]
        dur = {(j, b): profile.span_time(j, ends[b] - split[b] * g, ends[b])
               for j, b in ops}

        def extend(done, free, finish):
            nonlocal best
            if len(done) == len(ops):
                best = min(best, max(finish.values()))
                return
            for j, b in ops:
                if (j, b) in done:
                    continue
                i = OP_GROUPS.index(j)
                if i and (OP_GROUPS[i - 1], b) not in done:
                    continue
                r = profile.resource[j]
                t0 = max(free.get(r, 0.0), finish.get((OP_GROUPS[i - 1], b), 0.0) if i else 0)
                extend(done | {(j, b)}, {**free, r: t0 + dur[j, b]},
                       {**finish, (j, b): t0 + dur[j, b]})

        extend(frozenset(), {}, {})
    return best


CASES = [
    # attention-heavy: splitting lets attention hide under the GEMMs
    (512, 128, {"qkv": 1.0, "attention": 1.5, "o_proj": 0.5, "mlp": 2.0},
     {"qkv": 20, "attention": 5, "o_proj": 10, "mlp": 30}),
    # large fixed costs: splitting costs more than it hides
    (512, 128, {"qkv": 0.1, "attention": 0.1, "o_proj": 0.1, "mlp": 0.1},
     {"qkv": 100, "attention": 100, "o_proj": 100, "mlp": 100}),
    (768, 128, {"qkv": 0.7, "attention": 2.0, "o_proj": 0.3, "mlp": 1.2},
     {"qkv": 5, "attention": 1, "o_proj": 3, "mlp": 4}),
]


@pytest.mark.parametrize("b,g,per,fixed", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_stage1_finds_the_brute_force_optimum(b, g, per, fixed, k):
    prof = _profile(b, g, per, fixed)
    got = stage1(prof, k)
    assert got["makespan"] == pytest.approx(_brute(prof, k), rel=1e-6)
    assert sum(got["sizes"]) == b and all(s % g == 0 for s in got["sizes"])


def test_schedule_obeys_dependencies_and_resources():
    prof = _profile(*CASES[2])
    s = stage1(prof, 3)
    st, du = s["start"], s["duration"]
    for (j, b), t in st.items():
        i = OP_GROUPS.index(j)
        if i:
            prev = (OP_GROUPS[i - 1], b)
            assert t >= st[prev] + du[prev] - 1e-6
    ops = list(st)
    for a, c in itertools.combinations(ops, 2):
        if prof.resource[a[0]] == prof.resource[c[0]]:
            assert st[a] + du[a] <= st[c] + 1e-6 or st[c] + du[c] <= st[a] + 1e-6


def test_search_grows_k_and_writes_a_valid_plan():
    from nanojax.config import named_shape
    prof = _profile(*CASES[0])
    best = search(prof, max_k=3)
    assert best["k"] >= 2  # splitting pays on this profile
    plan = to_plan(prof, best, named_shape("llama3-8b").signature())
    check_order(plan)  # the executor accepts its order
    again = to_plan(prof, search(prof, max_k=3), named_shape("llama3-8b").signature())
    assert again == plan  # same input, same plan


def test_malformed_profile_is_named():
    with pytest.raises(SearchError, match="malformed profile"):
        Profile.from_dict({"b_dense": 256})
    with pytest.raises(SearchError, match="lacks sizes"):
        Profile.from_dict({"b_dense": 256, "granularity": 128, "ops": {
            j: {"resource": "compute", "times": {"128": 1.0}} for j in OP_GROUPS}})


def test_realistic_instance_and_cli(tmp_path):
    """B_dense 2048 in steps of 128, up to 4 nano-batches, through the CLI."""
    import json
    import subprocess
    import sys
    prof = _profile(2048, 128, CASES[2][2], CASES[2][3])
    d = {"b_dense": 2048, "granularity": 128,
         "ops": {j: {"resource": prof.resource[j],
                     "times": {str(n): t for n, t in prof.times[j].items()}}
                 for j in OP_GROUPS}}
    (tmp_path / "profile.json").write_text(json.dumps(d))
    res = subprocess.run([sys.executable, "-m", "nanojax", "search", "--profile",
                          str(tmp_path / "profile.json"), "--out", str(tmp_path / "plan.json"),
                          "--max-k", "4", "--png", str(tmp_path / "plan.png")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    from nanojax.pipeline.plan import load_plan
    plan = load_plan(tmp_path / "plan.json")
    assert len(plan["nano_batches"]["qkv"]) >= 2
    # one nano-batch per op back to back is a candidate: the plan is never predicted slower
    serial = sum(prof.times[j][2048] for j in OP_GROUPS)
    assert plan["predicted"]["makespan_s"] <= serial * (1 + 1e-9)
    assert (tmp_path / "plan.png").stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "nanojax", "search", "--profile",
                          str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot read profile" in bad.stderr


def _prefix_profile(b, g, decodes):
    """Attention over the dense batch's first n tokens: decodes (first) cost 4x a prefill
    token; GEMMs depend on size only."""
    prof = _profile(b, g, {"qkv": 1.0, "attention": 0.0, "o_proj": 0.5, "mlp": 2.0},
                    {"qkv": 10, "attention": 0, "o_proj": 5, "mlp": 20})
    prof.times["attention"] = {n: 4.0 * min(n, decodes) + 1.0 * max(0, n - decodes)
                               for n in range(g, b + 1, g)}
    prof.prefix = frozenset({"attention"})
    return prof


@pytest.mark.parametrize("k", [1, 2, 3])
def test_position_dependent_attention_matches_brute_force(k):
    prof = _prefix_profile(512, 128, decodes=256)
    got = stage1(prof, k)
    assert got["makespan"] == pytest.approx(_brute(prof, k), rel=1e-6)
    bounds = [0]
    for sz in got["sizes"]:
        bounds.append(bounds[-1] + sz)
    for b in range(k):  # each attention nano-op costs what its token span costs
        assert got["duration"][("attention", b)] == pytest.approx(
            prof.span_time("attention", bounds[b], bounds[b + 1]))


def test_prefix_profiles_load_from_json():
    d = {"b_dense": 256, "granularity": 128,
         "ops": {j: {"resource": "memory" if j == "attention" else "compute",
                     "times": {"128": 1.0, "256": 3.0}} for j in OP_GROUPS}}
    d["ops"]["attention"]["position"] = "prefix"
    p = Profile.from_dict(d)
    assert p.prefix == {"attention"} and p.span_time("attention", 128, 256) == 2.0
    assert p.span_time("qkv", 128, 256) == 1.0  # size only
    # timing noise that makes a longer prefix look faster (seen in CI under load) would
    # give a nano-batch a negative time and the MILP no solution: clamped at loading
    d["ops"]["attention"]["times"] = {"128": 3.0, "256": 2.5}
    p = Profile.from_dict(d)
    assert p.span_time("attention", 128, 256) == 0.0
    assert search(p, max_k=2)["makespan"] > 0


def _with_table(prof, overlapped: float, together: bool) -> Profile:
    """prof as JSON with a measured interference table (the profiler's format)."""
    d = {"b_dense": prof.b_dense, "granularity": prof.granularity,
         "ops": {j: {"resource": prof.resource[j],
                     "times": {str(n): t for n, t in prof.times[j].items()}}
                 for j in OP_GROUPS},
         "interference": {"measured": True, "tokens": prof.granularity, "rows": [
             {"share": r, "compute": 1.0, "memory": 1.0,
              "attention_overlapped_by_gemm": overlapped,
              "schedule": {"side_regions": 2, "issued_together": together}}
             for r in (0.5, 1.0)]}}
    return Profile.from_dict(d)


def test_a_device_that_ran_nothing_together_gets_a_plan_without_overlap():
    """The H200 profile's pair never overlapped (0.0 of attention under the GEMM): the
    search must then price every nano-op one after another, so splitting cannot pay."""
    base = _profile(*CASES[0])
    serial = _with_table(base, overlapped=0.0, together=True)
    assert not serial.concurrent and serial.interference == {}
    best = search(serial, max_k=3)
    total = sum(serial.times[j][serial.b_dense] for j in OP_GROUPS)
    assert best["k"] == 1 and best["makespan"] == pytest.approx(total)
    plan = to_plan(serial, best, {"num_layers": 1})
    assert {op["stream"] for op in plan["nano_ops"]} == {0}
    for k in (2, 3):  # with any split, no two nano-ops overlap in time
        s = stage1(serial, k)
        spans = sorted((s["start"][o], s["start"][o] + s["duration"][o]) for o in s["start"])
        tol = 1e-6 * s["makespan"]  # the solver's feasibility tolerance
        assert all(a_end <= b_start + tol for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert not _with_table(base, overlapped=0.4, together=False).concurrent
    overlapping = _with_table(base, overlapped=0.4, together=True)
    assert overlapping.concurrent and search(overlapping, max_k=3)["k"] >= 2


def _pair_record(gain: float, gemm_ms: float = 0.4) -> dict:
    """A fused-pair file (bench/kernels/fused_pair.py's layout) whose pair takes
    back_to_back / gain at every share; sides alone: GEMM gemm_ms, attention 0.6 ms
    (the GEMM at the full grid 0.3 ms)."""
    def case(ms):
        return {"case": "x", "ms": ms}
    b2b = 1.0
    return {"programs": 132, "device": "test", "gemms": {"mlp": {
        "xla_gemm": case(0.3), "back_to_back": case(b2b),
        "shares": [{"G": g, "gemm_sms": g, "attention_sms": 132 - g, "gemm": case(gemm_ms),
                    "attention": case(0.6), "pair": case(b2b / gain)}
                   for g in (44, 66, 88)]}}}


def test_interference_from_a_measured_pair():
    from search.pair import best_gain, interference_from_pair, pair_rows
    rec = _pair_record(gain=1.25)  # pair 0.8 ms: 0.8 / max(0.4, 0.6) = 1.333 slowdown
    rows = pair_rows(rec)
    assert [r["share"] for r in rows] == [pytest.approx(1 / 3), 0.5, pytest.approx(2 / 3)]
    s = 0.8 / 0.6
    assert rows[1]["compute"] == pytest.approx(0.3 / (0.4 * s))
    assert rows[1]["memory"] == pytest.approx(1 / s)
    assert rows[1]["pair_power_w"] is None  # no nvidia-smi samples in this record
    rec["gemms"]["mlp"]["shares"][1]["pair"]["power"] = {"power_w_mean": 650.0,
                                                         "sm_clock_mhz_mean": 1700.0}
    assert pair_rows(rec)[1]["pair_power_w"] == 650.0
    assert pair_rows(rec)[1]["pair_sm_clock_mhz"] == 1700.0
    assert best_gain(rec) == pytest.approx(1.25)
    table = interference_from_pair(rec, [0.25, 0.5, 1.0])
    # 0.25 lies below the measured shares: clamped to the nearest one, never "free"
    assert [r["share"] for r in table["rows"]] == [0.25, 0.5]
    assert table["rows"][0]["memory"] == pytest.approx(rows[0]["memory"])
    prof = Profile.from_dict({"b_dense": 512, "granularity": 128, "interference": table,
                              "ops": {j: {"resource": r, "times": {str(n): 1.0 * n for n in
                                                                   range(128, 513, 128)}}
                                      for j, r in (("qkv", "compute"), ("attention", "memory"),
                                                   ("o_proj", "compute"), ("mlp", "compute"))}})
    assert prof.concurrent and prof.interference[0.5] == pytest.approx(
        (rows[1]["compute"], rows[1]["memory"]))


@pytest.mark.parametrize("gain,gemm_ms,overlap,in_profile", [
    (0.95, 0.4, False, False), (1.6, 0.32, True, False),
    (0.95, 0.4, False, True), (1.6, 0.32, True, True)])
def test_the_search_plans_no_overlap_where_the_measured_pair_loses(tmp_path, gain, gemm_ms,
                                                                   overlap, in_profile):
    """Attention-heavy layer where splitting pays when overlap is free; a measured pair
    slower than back to back must give one nano-batch on one stream, with the reason; one
    that wins gives fused pairs (one launch each). The pair comes from --pair or from the
    profile's own "pair" (nanojax profile --pair-shares)."""
    import json

    from nanojax.cli import main
    prof = _profile(*CASES[0])
    d = {"b_dense": prof.b_dense, "granularity": prof.granularity,
         "ops": {j: {"resource": prof.resource[j],
                     "times": {str(n): t for n, t in prof.times[j].items()}}
                 for j in OP_GROUPS}}
    d["ops"]["attention"]["times_by_share"] = {
        "0.5": {str(n): 1.1 * t for n, t in prof.times["attention"].items()},
        "1.0": {str(n): t for n, t in prof.times["attention"].items()}}
    if in_profile:
        d["pair"] = _pair_record(gain, gemm_ms)
    (tmp_path / "profile.json").write_text(json.dumps(d))
    (tmp_path / "pair.json").write_text(json.dumps(_pair_record(gain, gemm_ms)))
    pair_flag = [] if in_profile else ["--pair", str(tmp_path / "pair.json")]
    assert main(["search", "--profile", str(tmp_path / "profile.json"), *pair_flag,
                 "--out", str(tmp_path / "plan.json"),
                 "--max-k", "3", "--time-limit", "20"]) == 0
    plan = validate(json.loads((tmp_path / "plan.json").read_text()))
    decision = plan["predicted"]["report"]["overlap"]
    assert decision["chosen"] is overlap
    assert decision["pair_best_gain_over_back_to_back"] == pytest.approx(gain)
    fused = [op for op in plan["nano_ops"] if "fused" in op]
    if not overlap:
        assert "cannot pay" in decision["reason"]
        assert len(plan["nano_batches"]["qkv"]) == 1
        assert {op["stream"] for op in plan["nano_ops"]} == {0}
        assert fused == [] and "fused_pairs" not in decision
    else:
        assert len(plan["nano_batches"]["qkv"]) >= 2
        assert fused and {op["op"] for op in fused} <= {"qkv", "o_proj", "mlp"}
        made = [e for e in decision["fused_pairs"] if "gemm" in e]
        assert len(made) == len(fused)
        for op in fused:  # G from stage II's share, or the best measured one (88 of 132)
            assert op["fused"]["programs"] == 132 and 0 < op["fused"]["gemm_programs"] < 132
            e = next(e for e in made if e["gemm"] == f"{op['op']}[{op['batch']}]")
            assert e["gemm_programs"] == op["fused"]["gemm_programs"]
            if e["g_from"] == "best measured G":  # a measured G
                assert op["fused"]["gemm_programs"] in (44, 66, 88)
    with pytest.raises(SystemExit, match="not a pair file"):
        (tmp_path / "bad.json").write_text("{}")
        main(["search", "--profile", str(tmp_path / "profile.json"), "--pair",
              str(tmp_path / "bad.json"), "--out", str(tmp_path / "x.json")])


def test_overlap_always_keeps_what_the_search_declined(tmp_path, capsys):
    """--overlap always: a losing measured pair still gives the overlapped schedule, fused
    pairs and all, and the report says it was forced and why the search would decline."""
    import json

    from nanojax.cli import main
    prof = _profile(*CASES[0])
    d = {"b_dense": prof.b_dense, "granularity": prof.granularity,
         "ops": {j: {"resource": prof.resource[j],
                     "times": {str(n): t for n, t in prof.times[j].items()}}
                 for j in OP_GROUPS}, "pair": _pair_record(0.95, 0.4)}
    (tmp_path / "profile.json").write_text(json.dumps(d))
    args = ["search", "--profile", str(tmp_path / "profile.json"), "--max-k", "3",
            "--time-limit", "20"]
    assert main([*args, "--out", str(tmp_path / "auto.json")]) == 0
    assert main([*args, "--overlap", "always", "--out", str(tmp_path / "forced.json")]) == 0
    auto = validate(json.loads((tmp_path / "auto.json").read_text()))
    forced = validate(json.loads((tmp_path / "forced.json").read_text()))
    assert not auto["predicted"]["report"]["overlap"]["chosen"]
    decision = forced["predicted"]["report"]["overlap"]
    assert decision["chosen"] and decision["forced"]
    assert "would plan none" in decision["reason"] and "cannot pay" in decision["reason"]
    assert len(forced["nano_batches"]["qkv"]) >= 2
    assert any("fused" in op for op in forced["nano_ops"])
    # where stage I kept one nano-batch, the best split of two or more is taken; with
    # --max-k 1 there is none, and the search says so
    from search.cli import _best_split
    from search.milp import Profile
    split = _best_split(Profile.from_dict(d), 2, 20)
    assert len(split["sizes"]) == 2 and sum(split["sizes"]) == d["b_dense"]
    assert main([*args[:-4], "--max-k", "1", "--overlap", "always",
                 "--out", str(tmp_path / "one.json")]) != 0
    assert not (tmp_path / "one.json").exists()
    assert "two or more nano-batches" in capsys.readouterr().err


def test_a_fused_pair_is_read_only_where_its_launch_passed_the_check():
    """nanojax's own pair records: a GEMM whose launch was not checked (a run cut short)
    or failed the check is not read; a reference file (PyTorch's) has no check."""
    from search.pair import best_gain, checked_gemms, pair_rows
    rec = _pair_record(gain=1.25)
    assert set(checked_gemms(rec)) == {"mlp"}  # no impl: a reference file
    rec["impl"] = "nanojax fused launch"
    rec["partial"] = True
    assert checked_gemms(rec) == {} and pair_rows(rec) == [] and best_gain(rec) is None
    rec["gemms"]["mlp"]["fused_rel_error"] = {"G": 66, "gemm": 3e-3,
                                              "attention_vs_swapab": 0.5}  # wrong attention
    assert checked_gemms(rec) == {}
    rec["gemms"]["mlp"]["fused_rel_error"]["attention_vs_swapab"] = 2e-3
    assert set(checked_gemms(rec)) == {"mlp"} and best_gain(rec) == pytest.approx(1.25)
