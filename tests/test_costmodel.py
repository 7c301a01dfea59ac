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
