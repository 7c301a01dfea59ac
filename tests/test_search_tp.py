"""The search with network nano-ops: a profile synthesized from the A100 datasheet for
LLaMA-2-70B at TP 8, both stages, and the plan the executor reads."""
from nanojax.config import named_shape
from nanojax.pipeline.plan import NETWORK_GROUPS, TP_GROUPS, single_device, validate
from search.costmodel import GPUS
from search.datasheet import datasheet_profile, non_overlap_time
from search.milp import Profile, search, to_plan
from search.shares import stage2


def _profile(tp=8, b_dense=512):
    return Profile.from_dict(datasheet_profile(GPUS["a100"], named_shape("llama2-70b"), tp,
                                               b_dense, 128, 1155, 211))


def test_datasheet_profile_has_network_ops_that_grow_with_tokens():
    prof = _profile()
    assert prof.groups == TP_GROUPS
    for g in NETWORK_GROUPS:
        assert prof.resource[g] == "network"
        t = prof.times[g]
        assert 0 < t[128] < t[512]
    # ring all-reduce of 512 x 8192 bf16 over 8 GPUs at 300 GB/s, plus 10 us
    assert prof.times["o_allreduce"][512] == __import__("pytest").approx(
        10e-6 + 512 * 8192 * 2 * 2 * 7 / 8 / 300e9)
    assert _profile(tp=1).groups == ("qkv", "attention", "o_proj", "mlp")


def test_both_stages_hide_collectives_and_the_plan_puts_them_on_stream_3():
    prof = _profile()
    best = search(prof, max_k=2, time_limit=20)
    assert best["k"] == 2
    best = stage2(prof, best, time_limit=20)
    assert best["makespan"] < non_overlap_time(prof)
    plan = validate(to_plan(prof, best, named_shape("llama2-70b").signature(), tp=8))
    assert set(plan["nano_batches"]) == set(TP_GROUPS)
    streams = {op["op"]: op["stream"] for op in plan["nano_ops"]}
    assert streams["o_allreduce"] == streams["mlp_allreduce"] == 3
    # some collective overlaps some GEMM of another nano-batch in the predicted schedule
    s, d = best["start"], best["duration"]
    assert any(prof.resource[a[0]] == "network" and prof.resource[b[0]] == "compute"
               and a[1] != b[1] and s[a] < s[b] + d[b] and s[b] < s[a] + d[a]
               for a in s for b in s)


def test_stage2_takes_a_schedule_whose_producer_starts_late():
    # a memory-bound shape (tiny at TP 2): stage I may order a collective so that a
    # consumer sorts before its producer; stage II must still see every variable
    prof = Profile.from_dict(datasheet_profile(GPUS["h200"], named_shape("tiny"), 2,
                                               256, 16, 1155, 211))
    best = stage2(prof, search(prof, max_k=3, time_limit=10), time_limit=10)
    assert best["makespan"] > 0
    plan = validate(to_plan(prof, best, named_shape("tiny").signature(), tp=2))
    assert plan["tp"] == 2


def test_single_device_plan_drops_the_network_ops():
    prof = _profile(tp=2)
    best = search(prof, max_k=2, time_limit=20)
    plan = validate(to_plan(prof, best, named_shape("llama2-70b").signature(), tp=2))
    one = single_device(plan)
    assert one["tp"] == 1 and set(one["nano_batches"]) == {"qkv", "attention", "o_proj", "mlp"}
    assert all(r == [[0, plan["b_dense"]]] for r in one["nano_batches"].values())
