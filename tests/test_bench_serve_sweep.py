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
                100.0 * rate, "normalized_latency_s_per_token": {"mean": mean, "p99": 2 * mean},
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
