"""The online latency sweep's logic (`nanojax bench serve --request-rates`), with the
client's run replaced by a server whose latency grows with the rate."""
import pytest

from nanojax.bench import serve_sweep


def _fake_server(latency_per_rate=0.05, fail_at=None):
    calls = []

    async def run(url, model, reqs, rate, seed, api_key, max_concurrency, progress):
        calls.append((rate, len(reqs), seed))
        failed = int(fail_at is not None and rate >= fail_at)
        mean = latency_per_rate * rate
        return {"request_rate": rate, "failed_requests": failed, "total_token_throughput":
                100.0 * rate, "request_throughput": min(rate, 6.0), "normalized_latency_s_per_token": {"mean": mean, "p99": 2 * mean},
                "per_request": [{}] * len(reqs)}
    return run, calls


def test_the_sweep_stops_at_saturation_and_names_the_best_rate(tmp_path):
    run, calls = _fake_server()
    made = []

    def make(n, seed):
        made.append(seed)
        return list(range(n))
    res = serve_sweep.run_sweep(run, "u", "m", [1, 2, 4, 8, 16, 32], make, seconds=10,
                                seed=7, progress=False, stop_factor=2.0)
    # 16/s is 0.8 s/token, past 2 x the 0.2 s SLO: 32/s never runs
    assert [c[0] for c in calls] == [1, 2, 4, 8, 16]
    assert [c[1] for c in calls] == [10, 20, 40, 80, 160]  # ~10 s of arrivals each
    assert len(set(made)) == len(made)  # fresh prompts per rate: no prefix-cache hits
    assert res["max_rate_within_slo"] == 4 and res["saturated"]
    assert all("per_request" not in p for p in res["sweep"])
    series = serve_sweep.sweep_series(res)
    assert series["mean_ms"] == pytest.approx([50, 100, 200, 400, 800])
    png = tmp_path / "sweep.png"
    serve_sweep.plot_sweeps({"sharegpt": res, "sharegpt, plan": res}, png)
    assert png.stat().st_size > 1000


def test_failures_keep_a_rate_out_of_the_slo():
    run, _ = _fake_server(latency_per_rate=0.01, fail_at=4)
    res = serve_sweep.run_sweep(run, "u", "m", [1, 2, 4], lambda n, s: [0] * n, seconds=1,
                                progress=False)
    assert res["max_rate_within_slo"] == 2 and res["saturated"]


def test_rates_and_plot_inputs_are_checked(tmp_path):
    assert serve_sweep.parse_rates("8, 2,4") == [2.0, 4.0, 8.0]
    for bad in ("", "2,x", "0,1", "inf", "nan"):
        with pytest.raises(SystemExit, match="request-rates"):
            serve_sweep.parse_rates(bad)
    (tmp_path / "one.json").write_text('{"successful_requests": 3}')
    with pytest.raises(SystemExit, match="no sweep"):
        serve_sweep.main([str(tmp_path / "one.json"), "--out", str(tmp_path / "x.png")])


def test_a_rate_the_server_did_not_keep_up_with_is_out_of_the_slo():
    """A short run past saturation ends before its queue pushes the latency past the SLO:
    the finished-over-arrived ratio keeps such a rate out; several files of one trace
    (rate ranges run apart) merge into one sweep."""
    from nanojax.bench.serve import RequestResult, completion_ratio_late
    kept = [RequestResult(1, 4, True, start=t, e2e=0.5) for t in range(20)]
    assert completion_ratio_late(kept) == 1.0
    # finishing one request a second while two arrive: half the late arrivals are served
    behind = [RequestResult(1, 4, True, start=t / 2, e2e=t / 2 + 0.1) for t in range(20)]
    assert completion_ratio_late(behind) < 0.6
    assert completion_ratio_late(kept[:1]) is None
    lat = {"mean": 0.05, "p99": 0.1}
    low = {"sweep": [{"request_rate": 2.0, "failed_requests": 0, "completion_ratio_late": 1.0,
                      "normalized_latency_s_per_token": lat}], "rates_planned": [2.0],
           "saturated": False}
    high = {"sweep": [{"request_rate": 64.0, "failed_requests": 0, "completion_ratio_late": 0.4,
                       "normalized_latency_s_per_token": lat},
                      {"request_rate": 8.0, "failed_requests": 0,
                       "normalized_latency_s_per_token": lat}],
            "rates_planned": [8.0, 64.0], "saturated": True}
    merged = serve_sweep.merge_sweeps([low, high])
    assert [p["request_rate"] for p in merged["sweep"]] == [2.0, 8.0, 64.0]
    assert merged["max_rate_within_slo"] == 8.0 and merged["saturated"]
