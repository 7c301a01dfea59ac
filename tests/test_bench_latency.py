"""`nanojax bench latency`'s plumbing on a tiny model: every figure is in its record, and
the ratios are computed from the run's own measurements."""
import json

import pytest

torch = pytest.importorskip("torch")


def test_latency_record_and_ratios(tmp_path, monkeypatch):
    from nanojax.bench import latency
    from nanojax.bench.peer import hf_model_config
    from nanojax.cli import main
    from nanojax.config import named_shape

    peer_cls = latency.TransformersPeer

    def tiny_peer(gguf, threads):  # transformers' LLaMA of the tiny shape, random weights
        assert gguf == "tiny.gguf"
        torch.manual_seed(0)
        cls, cfg = hf_model_config(named_shape("tiny"), 256)
        return peer_cls.from_model(cls(cfg).float(), threads)

    monkeypatch.setattr(latency, "TransformersPeer", tiny_peer)
    path = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", "random:tiny", "--peer-gguf", "tiny.gguf",
                 "--new-tokens", "3", "--prefill-tokens", "40", "--batch", "2",
                 "--repeats", "1", "--max-model-len", "128", "--threads", "1", "--quiet",
                 "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert rec["env"]["backend"] == "cpu" and rec["config"]["max_model_len"] == 128
    assert rec["threads"]["torch_num_threads"] == 1
    assert rec["engine"]["min_token_bucket"] == 1  # the CPU default
    assert rec["workload"]["new_tokens"] == 3 and rec["workload"]["batch"] == 2
    res = rec["results"]
    for r in res.values():
        for key in ("decode_wall_s", "prefill_wall_s", "batch_wall_s"):
            assert len(r[key]) == 1 and r[key][0] > 0  # the warm-up round is not counted
        assert r["decode_tokens_per_s"] == pytest.approx(3 / r["decode_wall_s"][0])
        assert r["prefill_ttft_s"] == pytest.approx(r["prefill_wall_s"][0])
        assert r["batch_tokens_per_s"] == pytest.approx(2 * 3 / r["batch_wall_s"][0])
        assert r["batch_over_single"] == pytest.approx(
            r["batch_tokens_per_s"] / r["decode_tokens_per_s"])
    ours, theirs, ratios = res["ours"], res["transformers"], rec["ratios"]
    assert ratios["decode_ours_over_transformers"] == pytest.approx(
        ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"])
    assert ratios["prefill_transformers_over_ours"] == pytest.approx(
        theirs["prefill_ttft_s"] / ours["prefill_ttft_s"])
    assert ratios["batch_ours_over_transformers"] == pytest.approx(
        ours["batch_tokens_per_s"] / theirs["batch_tokens_per_s"])
    assert rec["greedy_tokens_agree"]["of"] == 3
    bd = rec["decode_breakdown"]
    assert bd["bare_step_ms"] > 0 and bd["lm_head_ms"] > 0 and bd["step_shapes"]["tokens"] == 1
    assert "decode_ours_over_transformers" in latency.format_table(rec)
