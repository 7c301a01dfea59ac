"""FP8 weights and activations (--quantization fp8) on SmolLM2-135M against the
unquantized model (float32 weights and KV), and with an FP8 KV cache on top: greedy
agreement and the teacher-forced logits' distance, on the CPU (nanojax/bench/kv_quality.py).

16 prompts x 64 tokens here; the 64 x 64 run and its numbers are in
bench/results/fp8/fp8_weights_quality_cpu.json (bench/repro/fp8/weights_quality_cpu.py):
FP8 weights top-1 agreement 91.3%, mean KL 0.028; with FP8 KV 90.1%, 0.038 (bf16 KV alone,
for scale: 99.8%, 2e-5). Most of it is the weights' e4m3 rounding (3 mantissa bits): the
weights alone, activations in float32, give 90.9% on 12 prompts, each projection alone
96-99%, so this 135M model sits below the 95% the issue asked. The floors sit under the
measurement with margin; a broken FP8 path (a wrong scale, a transposed weight, no
saturation) lands far outside them.
"""
import pytest

from checkpoints.loader import quantize_bundle
from nanojax.bench.kv_quality import QUALITY_PROMPTS, measure_variants


@pytest.mark.slow
def test_fp8_weights_stay_close_to_the_float_model(smollm2):
    fp8 = quantize_bundle(smollm2, "fp8")
    res = measure_variants({"float32": (smollm2, "auto"), "fp8": (fp8, "auto"),
                            "fp8+kv": (fp8, "fp8")}, "float32", QUALITY_PROMPTS[:16], 64,
                           group=1, log=lambda m: None)  # group: see test_fp8_kv_quality
    w8, w8kv = res["compared"]["fp8"], res["compared"]["fp8+kv"]
    print(res["generate_seconds"], res["teacher_forced_seconds"], w8, w8kv)
    assert w8["scored_positions"] == w8kv["scored_positions"] == 16 * 64
    # measured on these 16 prompts (and on all 64)
    assert w8["top1_agreement"] >= 0.87                    # 0.915 (0.913)
    assert w8["mean_kl"] <= 0.05                           # 0.025 (0.028)
    assert w8["tokens_before_first_divergence"] >= 0.04    # 0.081 (0.128)
    assert w8kv["top1_agreement"] >= 0.86                  # 0.911 (0.901)
    assert w8kv["mean_kl"] <= 0.07                         # 0.033 (0.038)
