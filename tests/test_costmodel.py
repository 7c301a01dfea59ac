"""NanoFlow's cost model: verdicts, monotonicity, and the CLI contract."""
import json
import subprocess
import sys

import pytest

from nanojax.config import named_shape
from search.costmodel import GPUS, analyze, gpu_from, table


def test_large_batch_70b_is_compute_bound_small_batch_memory_bound():
    cfg = named_shape("llama2-70b")
    big = analyze(GPUS["a100"], cfg, 2048, tp=8, prompt=1155, output=211)
    small = analyze(GPUS["a100"], cfg, 16, tp=8, prompt=1155, output=211)
    assert big["bound"] == "compute" and big["TR"] < 1
    assert small["bound"] == "memory" and small["TR"] > 1
    assert big["optimal_tokens_per_s_per_gpu"] == pytest.approx(312e12 / (2 * cfg.param_count()))


def test_ratios_fall_with_batch_and_slow_network_binds():
    cfg = named_shape("llama3-70b")
    trs = [analyze(GPUS["h100"], cfg, b, tp=8)["TR"] for b in (64, 256, 1024, 4096)]
    assert trs == sorted(trs, reverse=True)
    slow = analyze(gpu_from("h100", net_gbps=10), cfg, 2048, tp=8)
    assert slow["bound"] == "network" and slow["T_net_over_T_compute"] > 1
    assert analyze(GPUS["h100"], cfg, 2048, tp=1)["T_net_s"] == 0


def test_table_covers_gpus_and_models():
    rows = table()
    assert {r["gpu"] for r in rows} >= {GPUS[g].name for g in ("v100", "a100", "h100", "h200",
                                                                "b200")}
    assert all(r["bound"] == "compute" for r in rows)  # B_dense 2048 on every datasheet GPU


def test_cli_json_contract(tmp_path):
    res = subprocess.run([sys.executable, "-m", "nanojax", "costmodel", "--gpu", "a100",
                          "--model", "llama2-70b", "--tp", "8", "--batch", "2048", "--json",
                          "--plot", str(tmp_path / "tr.png")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert {"TR", "T_net_over_T_compute", "bound", "optimal_tokens_per_s_per_gpu"} <= set(out)
    assert (tmp_path / "tr.png").stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "nanojax", "costmodel", "--gpu", "tpu"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown GPU 'tpu'" in bad.stderr


def test_moe_optimal_uses_active_parameters_and_small_nano_batches_cost_more():
    from search.moe_cost import expert_time
    cfg = named_shape("mixtral-8x7b")
    whole = analyze(GPUS["h200"], cfg, 2048)
    assert whole["optimal_tokens_per_s_per_gpu"] == pytest.approx(
        989e12 / (2 * cfg.active_param_count()))
    assert cfg.active_param_count() < 0.3 * cfg.param_count()
    effs = [analyze(GPUS["h200"], cfg, 2048, nano_batch=n)["expert_gemm_efficiency"]
            for n in (2048, 1024, 512, 256)]
    assert effs == sorted(effs, reverse=True) and effs[0] > 0.9 and effs[-1] < 0.4
    # the compute time grows by exactly the experts' lost efficiency
    half = analyze(GPUS["h200"], cfg, 2048, nano_batch=512)
    assert half["T_compute_s"] - whole["T_compute_s"] == pytest.approx(
        half["T_experts_s"] - whole["T_experts_s"])
    # a router that favours one expert: more imbalance, less efficiency
    skew = analyze(GPUS["h200"], cfg, 2048, nano_batch=512, expert_load=[4] + [1] * 7)
    assert skew["router_imbalance"] > 2 * half["router_imbalance"]
    assert skew["expert_gemm_efficiency"] < half["expert_gemm_efficiency"]
    # a tiny batch reads only the experts some token chose
    one = expert_time(cfg, 1, 989e12, 4.8e12)
    assert one["experts_hit"] == pytest.approx(2.0) and one["efficiency"] < 0.01
    # dense models are untouched by the MoE terms
    dense = analyze(GPUS["h200"], named_shape("llama3-8b"), 2048, nano_batch=256)
    assert "expert_gemm_efficiency" not in dense and dense["active_params"] == dense["params"]


def test_roofline_counts_active_parameters_and_expert_shapes():
    from nanojax.bench.roofline import gemm_shapes, optimal_tokens_per_s
    cfg = named_shape("mixtral-8x7b")
    assert optimal_tokens_per_s(cfg, 790e12) == pytest.approx(
        790e12 / (2 * cfg.active_param_count()))
    shapes = gemm_shapes(cfg, 2048)
    # each of the 8 experts sees 2048 * 2 / 8 = 512 rows; one form's FLOPs are the
    # active expert FLOPs of the layer
    assert shapes["down"] == [[(512, 14336, 4096)] * 8]
    flops = sum(2 * m * k * n for m, k, n in shapes["gate_up"][0] + shapes["down"][0])
    assert flops == 2 * 2048 * 2 * 3 * 4096 * 14336
    assert "shared" in gemm_shapes(named_shape("qwen2-57b-a14b"), 2048)
