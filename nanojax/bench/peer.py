"""The PyTorch peer: the same workload through transformers' continuous batching
(`generate_batch`, paged attention) on a model of the same shape with random bf16 weights.

Runs as its own process (`python -m nanojax.bench.peer ...`), before JAX takes the GPU's
memory, and prints one JSON line. Tokens are counted from what generate_batch returned.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_peer(shape: str, num_prompts: int, input_len: int | None, output_len: int | None,
             trace: str | None, max_model_len: int, seed: int = 0) -> dict:
    import torch
    import transformers
    from transformers import GenerationConfig

    from nanojax.bench.workload import make_requests
    from nanojax.config import named_shape

    cfg = named_shape(shape)
    model_cls, hf_cfg = hf_model_config(cfg, max_model_len)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # built in bf16 directly: Mixtral-8x7B in f32 (187 GB) would not fit an H200
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = model_cls(hf_cfg).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    # generate_batch switches the model to its paged attention itself
    reqs = make_requests(num_prompts, cfg.vocab_size, input_len, output_len, trace,
                         max_model_len, seed)
    max_new = max(r.output_len for r in reqs)
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    prompts = [r.prompt_ids for r in reqs]
    batching = {}
    if device == "cpu":  # CPU smoke runs: transformers would size its cache from free RAM
        from transformers import ContinuousBatchingConfig
        batching["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=16, max_batch_tokens=256)
    # no_grad, not inference_mode: generate_batch runs its scheduler in a thread outside
    # this context, and transformers 5.17 fails there on in-place updates of inference
    # tensors (every request "failed during generation", zero tokens)
    # the warm-up needs the kernels, not the length: 16 tokens (it decoded the workload's
    # whole output before, and the Mixtral-8x7B peer ran past its time limit:
    # bench/results/log/moe.md)
    warm = GenerationConfig(max_new_tokens=min(max_new, 16), do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:8], generation_config=warm, progress_bar=False,
                             **batching)
        _sync(torch)
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False,
                                   **batching)
        _sync(torch)
        wall = time.perf_counter() - t0
    attn = getattr(model.config, "_attn_implementation", "?")
    outputs = list(out.values())
    produced = sum(len(o.generated_tokens) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"stack": f"transformers {transformers.__version__} generate_batch ({attn}), "
                     f"torch {torch.__version__}",
            "requests": len(outputs), "prompt_tokens": prompt_tokens, "output_tokens": produced,
            "max_new_tokens": max_new, "wall_s": wall,
            "total_tokens_per_s": (prompt_tokens + produced) / wall,
            "note": "all requests get the workload's largest output length as max_new_tokens"
                    if trace else ""}


def hf_model_config(cfg, max_model_len: int = 2048):
    """(transformers model class, config) of the same shape: LLaMA, Qwen3, Mixtral,
    Qwen2-MoE or Qwen3-MoE."""
    import transformers
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=max(max_model_len, 2048),
        tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if cfg.architecture == "mixtral":
        return transformers.MixtralForCausalLM, transformers.MixtralConfig(
            intermediate_size=cfg.moe_intermediate_size, num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok, **common)
    if cfg.architecture == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob, **common)
    if cfg.architecture == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob, **common)
    if cfg.architecture == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            intermediate_size=cfg.intermediate_size, **common)
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        intermediate_size=cfg.intermediate_size, **common)


def run_peer_subprocess(args_list: list[str], timeout: float = 900) -> dict:
    """Runs the peer in a child process (it must not share the GPU with JAX's allocator)."""
    import subprocess
    try:
        p = subprocess.run([sys.executable, "-m", "nanojax.bench.peer", *args_list],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its output comes back as bytes here
        tail = e.stderr or b""
        return {"error": f"the peer did not finish within {timeout:.0f} s",
                "stderr_tail": (tail.decode(errors="replace") if isinstance(tail, bytes)
                                else tail)[-1500:]}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    result = json.loads(lines[-1])
    if not result.get("output_tokens"):  # generate_batch can fail inside and return nothing
        return {"error": "the peer produced no tokens", "peer": result,
                "stderr_tail": p.stderr[-1500:]}
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps(run_peer(a.shape, a.num_prompts, a.input_len, a.output_len, a.trace,
                              a.max_model_len, a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
