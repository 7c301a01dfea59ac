"""Configuration, in one place: the model (ModelConfig: read from HF config.json, GGUF
metadata or a named shape), the kernels and execution choices (KernelConfig) and the
serving engine (EngineConfig, which holds a KernelConfig). All are frozen dataclasses,
read when an engine or benchmark is built; `nanojax/config_flags.py` turns the last two
into CLI flags, and every result file records them."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nanojax.errors import ConfigError, UnsupportedError

_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8", "fp8-block")       # ModelConfig.quantization (layers/fp8.py)
ACTIVATION_SCALES = ("dynamic", "static")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a LLaMA-family decoder (LLaMA 2/3, SmolLM, Qwen2, Qwen3) and its
    mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE): num_experts > 0 replaces
    every layer's FFN by a routed MoE block (nanojax/models/moe.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} or GGUF's {"freq_factors": [...]}; None for plain.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on every q and k head, pre-RoPE
    dtype: str = "bfloat16"
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense FFN of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0          # top-k experts per token
    moe_intermediate_size: int = 0        # each expert's FFN width
    norm_topk_prob: bool = False          # renormalise the top-k weights (Mixtral: yes)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    # Weight quantization of the dense projections and MoE experts (nanojax/layers/fp8.py):
    # None, or "fp8" (e4m3 weights with per-channel scales, per (expert, channel) for the
    # experts, FP8 activations per token, f32 accumulation), or "fp8-block" (dense models:
    # one weight scale per 128 x 128 block and activation scales per 128-wide group, as
    # DeepSeek-V3 / Qwen3-FP8 checkpoints are made; pallas_kernels/block_fp8_matmul_mgpu.py);
    # activation_scale: "dynamic" (per token, computed on the fly) or "static" (each
    # projection's input_scale, from an FP8 checkpoint)
    quantization: str | None = None
    activation_scale: str = "dynamic"

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts < 0 or self.shared_expert_intermediate_size < 0:
            raise ConfigError("num_experts and shared_expert_intermediate_size must be >= 0")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok must be in [1, num_experts="
                                  f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("an MoE config needs moe_intermediate_size > 0")
        elif self.num_experts_per_tok or self.shared_expert_intermediate_size:
            raise ConfigError("num_experts_per_tok / shared expert set without num_experts")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise UnsupportedError(f"quantization {self.quantization!r} is not supported "
                                   f"(supported: {', '.join(QUANTIZATIONS)})")
        if self.activation_scale not in ACTIVATION_SCALES:
            raise ConfigError(f"activation_scale must be one of {ACTIVATION_SCALES}, "
                              f"got {self.activation_scale!r}")
        if self.quantization == "fp8-block" and (self.is_moe or
                                                 self.activation_scale == "static"):
            raise UnsupportedError("fp8-block covers dense models with dynamic activation "
                                   "scales; use quantization 'fp8' (per channel) here")
        if self.quantization and self.is_moe and self.activation_scale == "static":
            # the experts' rows are quantized per token (one activation scale per row of
            # the grouped GEMM); a checkpoint's per-expert input_scale has no place there
            raise UnsupportedError("FP8 MoE models quantize activations per token "
                                   "(activation_scale 'dynamic'); static activation "
                                   "scales cover dense models only")

    def __hash__(self):  # rope_scaling is a dict: hash the serialised form
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    # ---- derived -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def _ffn_params(self, experts: int) -> int:
        """One layer's FFN parameters, counting `experts` routed experts."""
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.intermediate_size
        n = experts * 3 * h * self.moe_intermediate_size + h * self.num_experts  # + router
        if self.shared_expert_intermediate_size:
            n += 3 * h * self.shared_expert_intermediate_size + h  # + its sigmoid gate
        return n

    def param_count(self, experts: int | None = None) -> int:
        h, v = self.hidden_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        ffn = self._ffn_params(self.num_experts if experts is None else experts)
        layer = attn + ffn + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head

    def active_param_count(self) -> int:
        """Parameters one token computes with: only its top-k experts (the router and a
        shared expert always). Optimal throughput is FLOP/s / (2 x this)."""
        return self.param_count(self.num_experts_per_tok)

    def kv_bytes_per_token(self, kv_itemsize: int | None = None) -> int:
        """K and V bytes of one token over all layers; kv_itemsize: the cache's element
        size when it differs from the model's (1 for an FP8 cache; its per-head scales
        are a few bytes per layer, not per token)."""
        return 2 * self.num_layers * self.kv_size * (kv_itemsize or self.itemsize)

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def signature(self) -> dict:
        """What a pipeline plan must match."""
        sig = {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
               "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
               "head_dim": self.head_dim, "intermediate_size": self.intermediate_size}
        if self.is_moe:  # dense signatures (and shipped dense plans) stay as they were
            sig.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        return sig

    # ---- (de)serialisation -----------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown model config keys: {sorted(unknown)}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"bad model config: {e}") from None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"missing model config file: {path}")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"corrupt model config {path}: {e}") from None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str = "bfloat16") -> "ModelConfig":
        """From a Hugging Face config.json (LlamaForCausalLM, Qwen2ForCausalLM, ...)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in HF_MODEL_TYPES:
            arch = ", ".join(hf.get("architectures") or []) or "?"
            raise UnsupportedError(f"model_type {model_type!r} ({arch}) is not supported by "
                                   f"nanojax (supported: {', '.join(HF_MODEL_TYPES)})")
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            # transformers >= 5 writes rope_parameters (theta inside); older, rope_scaling
            rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
            theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
            kind = rope.get("rope_type", rope.get("type", "default"))
            scaling = None
            if kind not in ("default", None):
                scaling = rope
                if kind != "llama3":
                    raise ConfigError(f"unsupported rope_scaling type {kind!r} (only llama3)")
                scaling = {k: scaling[k] for k in ("factor", "low_freq_factor",
                                                   "high_freq_factor",
                                                   "original_max_position_embeddings")}
            return cls(
                vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads", heads)),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=_full_attention_context(hf),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", hf.get(
                    "qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                dtype=dtype, architecture=model_type,
                bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos, **_hf_moe(hf))
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e}") from None


def _full_attention_context(hf: dict[str, Any]) -> int:
    """The context the model is served up to. nanojax attends over the whole context in
    every layer; where some layer of the checkpoint attends within a sliding window
    (Mistral-7B-v0.1's 4096; Qwen2/3 with use_sliding_window), that equals it up to the
    window, so the context stops there."""
    context = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or not 0 < window < context:
        return context
    types = hf.get("layer_types")
    if isinstance(types, list):  # transformers >= 5 names each layer's attention
        slides = "sliding_attention" in types
    elif "use_sliding_window" in hf:  # Qwen2/3: layers from max_window_layers on slide
        slides = bool(hf["use_sliding_window"]) and int(
            hf.get("max_window_layers") or 0) < int(hf["num_hidden_layers"])
    else:  # Mistral / Mixtral: every layer
        slides = True
    return window if slides else context


HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")


def _hf_moe(hf: dict[str, Any]) -> dict:
    """The MoE fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json ({} for dense)."""
    model_type = hf.get("model_type")
    if model_type == "mixtral":  # every expert is the model's FFN; top-k renormalised
        return dict(num_experts=int(hf["num_local_experts"]),
                    num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step, dense = int(hf.get("decoder_sparse_step") or 1), hf.get("mlp_only_layers") or []
        if step != 1 or dense:  # one layer type keeps the layers stackable (ScanForward)
            raise UnsupportedError(
                f"{model_type} with dense layers among the MoE ones (decoder_sparse_step={step}, "
                f"mlp_only_layers={dense}) is not supported: nanojax runs every layer as MoE")
        # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts
        experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
        return dict(num_experts=int(experts),
                    num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=int(
                        hf.get("shared_expert_intermediate_size") or 0))
    return {}


# Named shapes for shape-only benchmarks and tests (no download, random weights).
NAMED_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                        max_position_embeddings=1024, dtype="float32"),
    # a 2-layer Mixtral (4 experts, top 2) for CPU runs of the MoE paths
    "tiny-moe": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                            max_position_embeddings=1024, dtype="float32",
                            architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=96, norm_topk_prob=True),
    # a 2-layer Qwen3 (q/k norms; head_dim 32 = twice hidden // heads) for CPU runs
    "tiny-qwen3": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=160,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                              rope_theta=1000000.0, max_position_embeddings=1024,
                              dtype="float32", architecture="qwen3", qk_norm=True),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                rope_theta=100000.0, max_position_embeddings=8192,
                                tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                              rope_theta=500000.0, max_position_embeddings=8192),
    "llama2-70b": ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                              rope_theta=10000.0, max_position_embeddings=4096),
    "qwen2-72b": ModelConfig(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                             num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                             rope_theta=1000000.0, max_position_embeddings=32768,
                             attention_bias=True, architecture="qwen2"),
    # LLaMA architecture (deepseek-ai/deepseek-llm-67b-base config.json)
    "deepseek-67b": ModelConfig(vocab_size=102400, hidden_size=8192, intermediate_size=22016,
                                num_layers=95, num_heads=64, num_kv_heads=8, head_dim=128,
                                rope_theta=10000.0, max_position_embeddings=4096,
                                rms_norm_eps=1e-6),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of the 14336-wide FFN, top 2, renormalised
    "mixtral-8x7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                rope_theta=1000000.0, max_position_embeddings=32768,
                                architecture="mixtral", num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=14336, norm_topk_prob=True),
    # Qwen/Qwen2-57B-A14B: 64 experts of 2560, top 8 (not renormalised), a 20480-wide
    # shared expert behind a sigmoid gate
    "qwen2-57b-a14b": ModelConfig(vocab_size=151936, hidden_size=3584, intermediate_size=18944,
                                  num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                                  rope_theta=1000000.0, max_position_embeddings=131072,
                                  rms_norm_eps=1e-6, attention_bias=True,
                                  architecture="qwen2_moe", num_experts=64,
                                  num_experts_per_tok=8, moe_intermediate_size=2560,
                                  shared_expert_intermediate_size=20480),
    # Qwen/Qwen3-8B: q/k RMSNorm per head, no biases
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            rope_theta=1000000.0, max_position_embeddings=40960,
                            rms_norm_eps=1e-6, qk_norm=True, architecture="qwen3"),
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, top 8, renormalised, no shared expert
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                 rope_theta=1000000.0, max_position_embeddings=40960,
                                 rms_norm_eps=1e-6, qk_norm=True, architecture="qwen3_moe",
                                 num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, norm_topk_prob=True),
}


RANDOM_PREFIX = "random:"  # a model name `random:<shape>`: a named shape, random weights


def named_shape(name: str, dtype: str | None = None) -> ModelConfig:
    if name not in NAMED_SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; known: {sorted(NAMED_SHAPES)}")
    cfg = NAMED_SHAPES[name]
    return cfg.replace(dtype=dtype) if dtype else cfg


DECODE_KERNELS = ("auto", "triton", "mosaic", "mosaic-rows")
GROUPED_GEMMS = ("auto", "xla")
ACT_QUANTS = ("xla", "auto", "pallas")
CPU_GEMMS = ("eigen", "ynnpack")
CPU_WEIGHTS = ("q4", "f32")


def _opt(help: str, **kw) -> dict:
    """Field metadata: the help text of its CLI flag (and choices, ...)."""
    return {"help": help, **kw}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which kernel runs each part of the step on the GPU, and how the executor places
    them. Off the GPU the step is pure JAX (LayerwiseForward): `cpu_small_gemms` picks
    XLA's GEMM library there, and `interpret` runs the Pallas kernels in interpret mode
    (tests)."""

    decode_kernel: str = dataclasses.field(default="auto", metadata=_opt(
        "paged decode attention kernel: triton (any GPU), mosaic (Mosaic GPU swap-AB "
        "kernel, Hopper), mosaic-rows (the earlier Mosaic GPU kernel), auto (mosaic where "
        "it takes the operands on Hopper, else triton)", choices=DECODE_KERNELS))
    decode_prefetch: bool | None = dataclasses.field(default=None, metadata=_opt(
        "Triton decode kernel: load the next block before computing this one (default: "
        "on for grids of two programs per SM or fewer)"))
    decode_longest_first: bool = dataclasses.field(default=True, metadata=_opt(
        "Mosaic GPU swap-AB decode kernel: its workers take the sequences longest first, "
        "dealt in a snake, instead of round-robin in row order, so varied context lengths "
        "(the traces) leave no worker a tail of long ones (measured: "
        "bench/results/log/step.md)"))
    decode_fp8_query: bool = dataclasses.field(default=False, metadata=_opt(
        "Mosaic GPU swap-AB decode kernel on FP8 pages: the query quantized to e4m3 per "
        "(sequence, kv head) too, so QK^T is an FP8 WGMMA on the keys as loaded, no "
        "widening (the query's rounding on the scores; off until timed on a GPU)"))
    prefill_kernel: bool = dataclasses.field(default=True, metadata=_opt(
        "GPU: prefill tokens through the chunked-prefill kernel (query blocks of a chunk "
        "share one pass over the pages) instead of as rows of the decode kernel, each "
        "re-reading its context (faster in the step, and in the engine at load; measured: "
        "bench/results/log/step.md)"))
    prefill_block_q: int = dataclasses.field(default=16, metadata=_opt(
        "query tokens per block of the chunked-prefill kernel"))
    prefill_max_seqs: int = dataclasses.field(default=64, metadata=_opt(
        "with the chunked-prefill kernel: most sequences prefilling in one iteration; its "
        "query blocks are then at most B_dense / prefill_block_q + this, not "
        "B_dense / prefill_block_q + B_dense (one block per row); each block is gathered, "
        "attended and scattered back in every layer"))
    fused_append: bool = dataclasses.field(default=True, metadata=_opt(
        "write the KV cache with the fused RoPE + append kernel where it takes the shapes "
        "(kv heads and head dim powers of 2; else, and off: XLA's RoPE and two scatters); "
        "on, the step is faster (measured: bench/results/log/step.md)"))
    grouped_gemm: str = dataclasses.field(default="auto", metadata=_opt(
        "MoE expert GEMMs: auto (the Mosaic GPU grouped GEMM on Hopper where it takes the "
        "operands, else XLA's ragged_dot), xla (always ragged_dot)", choices=GROUPED_GEMMS))
    act_quant: str = dataclasses.field(default="auto", metadata=_opt(
        "FP8 weights (--quantization fp8): who quantizes a projection's input per token: "
        "xla (after its producer, two passes of their own), pallas (fused into RMSNorm "
        "and SiLU x up: pallas_kernels/act_quant.py; interpreted off the GPU), auto "
        "(pallas on a GPU, where the fused kernels measured faster: bench/results/log/fp8.md)",
        choices=ACT_QUANTS))
    cpu_small_gemms: str = dataclasses.field(default="eigen", metadata=_opt(
        "CPU: XLA's library for the GEMMs of steps of 3 to 16 rows (XLA's own GEMV "
        "serves 1 row): eigen (faster than YNNPACK at these sizes on the CPU) or ynnpack "
        "(XLA's default, kept for 2 rows and from 17 up, where it is the faster; measured: "
        "bench/results/log/cpu.md)",
        choices=CPU_GEMMS))
    cpu_weights: str = dataclasses.field(default="q4", metadata=_opt(
        "CPU, a model loaded from a GGUF file: q4 keeps its Q4_1 / Q8_0 blocks beside the "
        "f32 weights and runs steps of up to cpu_quant_max_rows rows from them (one fused "
        "GEMV reading 1 byte a weight, layers/quant.py), f32 runs every step from the "
        "dequantized weights", choices=CPU_WEIGHTS))
    cpu_quant_max_rows: int = dataclasses.field(default=1, metadata=_opt(
        "with cpu_weights q4: most tokens (and logits rows) a step may have to run from the "
        "quantized weights (2 rows and up recompute them per row: slower than f32)"))
    gemm_shares: bool = dataclasses.field(default=False, metadata=_opt(
        "plan GEMM nano-ops with a share below 1 run on that share of the SMs "
        "(Mosaic GPU matmul, Hopper)"))
    merge_dots: bool = dataclasses.field(default=False, metadata=_opt(
        "GPU: let XLA merge GEMMs that share an input (q, k and v: its dot merger, for "
        "GEMMs under 32 MB) into one, which concatenates their weights on every step (off, "
        "the 8B step is faster; q/k/v stored as one weight instead gained less: their "
        "output's slices cost what the merge saved; untimed on small models, where gate and "
        "up are under the threshold too; measured: bench/results/log/step.md)"))
    command_buffers: bool = dataclasses.field(default=False, metadata=_opt(
        "GPU: run the step as XLA command buffers (CUDA graphs) where it places nothing "
        "on other streams (the default forward, the non-overlap and nanobatch-only plans): "
        "one graph launch instead of a launch per kernel. Off: on the H200 the graph launch "
        "cost more per call than it saved, and back to back it gained little (measured: "
        "bench/results/log/step.md; bench step's mode option cmdbuf)"))
    streams: bool = dataclasses.field(default=True, metadata=_opt(
        "place the plan's side-stream nano-ops on XLA execution streams (GPU)"))
    interpret: bool = dataclasses.field(default=False, metadata=_opt(
        "run the Pallas kernels in interpret mode (CPU tests)", cli=False))

    def __post_init__(self):
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"unknown decode kernel {self.decode_kernel!r}; known: "
                              f"{', '.join(DECODE_KERNELS)}")
        if self.act_quant not in ACT_QUANTS:
            raise ConfigError(f"unknown act_quant {self.act_quant!r}; known: {ACT_QUANTS}")
        if self.grouped_gemm not in GROUPED_GEMMS:
            raise ConfigError(f"unknown grouped GEMM {self.grouped_gemm!r}; known: "
                              f"{', '.join(GROUPED_GEMMS)}")
        if self.cpu_small_gemms not in CPU_GEMMS:
            raise ConfigError(f"unknown CPU GEMM library {self.cpu_small_gemms!r}; known: "
                              f"{', '.join(CPU_GEMMS)}")
        if self.cpu_weights not in CPU_WEIGHTS:
            raise ConfigError(f"unknown CPU weights {self.cpu_weights!r}; known: "
                              f"{', '.join(CPU_WEIGHTS)}")
        for name in ("prefill_block_q", "prefill_max_seqs", "cpu_quant_max_rows"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def replace(self, **kw) -> "KernelConfig":
        return dataclasses.replace(self, **kw)


ADMISSION = ("greedy", "predicted")
# the default dense batch: a GPU's largest (EngineConfig.dense_batch: smaller where the
# KV cache cannot keep it full); the CPU's holds a whole prompt of the default
# max_model_len, so a long prompt prefills in one step of big GEMMs rather than in chunks
# of 256 (measured: bench/results/log/cpu.md)
GPU_B_DENSE = 2048
CPU_B_DENSE = 2048
# EngineConfig fields that steer only the host (the scheduler and its admission, which
# token counts a step is padded to, the prefix cache's bookkeeping, dispatch and compile
# threads, the collector): the compiled step is the same program whatever they are (its
# argument shapes are in its key already), so the step cache (nanojax/step_cache.py)
# leaves them out of its key: an A/B of one of them on a GPU loads the other's
# executables instead of tracing every step shape again. (Not memory_utilization: the
# CLI hands it to XLA's allocator, whose limit XLA compiles against.)
HOST_ONLY_FIELDS = ("async_scheduling", "admission", "fit_step_shapes", "prefill_spread",
                    "min_token_bucket", "token_bucket_step", "seed", "enable_prefix_caching",
                    "step_cache", "compile_threads", "async_dispatch", "gc_freeze")
# --kv-cache-dtype names (nanojax/layers/kv_fp8.py maps them to element types)
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3", "float32", "fp32")


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the engine's defaults depend on: the backend, its SM count, the host's cores."""
    gpu: bool
    num_sms: int
    host_cores: int

    @staticmethod
    def current() -> "Platform":
        """The first device's (where the engine puts the parameters)."""
        import os

        import jax

        from pallas_kernels.device import device_sms
        dev = jax.devices()[0]
        return Platform(dev.platform == "gpu", device_sms(dev), os.cpu_count() or 2)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The serving engine: batch shape, KV cache, scheduling, and the kernels."""

    b_dense: int | None = dataclasses.field(default=None, metadata=_opt(
        "tokens per iteration (NanoFlow's dense batch); default on a GPU: the largest the KV "
        "cache keeps full (4 x its tokens / max_model_len, in 256s, at most 2048); on the "
        "CPU 2048 (longer prefill chunks: bigger GEMMs)"))
    page_size: int = dataclasses.field(default=16, metadata=_opt("tokens per KV page"))
    num_pages: int | None = dataclasses.field(default=None, metadata=_opt(
        "KV pages (default: sized from free device memory; 8 full requests on the CPU)"))
    memory_utilization: float = dataclasses.field(default=0.9, metadata=_opt(
        "GPU: the share of the card's memory this process takes, as vLLM's flag: weights, "
        "XLA's work buffers (a tenth of the share) and the KV cache, which gets the rest. "
        "The CLI sizes jax's allocator to it (jax's own default, 0.75, left a fifth of the "
        "cache unused) unless XLA_CLIENT_MEM_FRACTION is set (in Python jax starts before "
        "the engine: set that variable first); the cache keeps to this share within the "
        "allocator's", flag="gpu-memory-utilization"))
    max_num_seqs: int | None = dataclasses.field(default=None, metadata=_opt(
        "most requests running at once (default: from KV capacity)"))
    max_model_len: int = dataclasses.field(default=2048, metadata=_opt(
        "longest request (prompt + output) in tokens"))
    async_scheduling: bool = dataclasses.field(default=True, metadata=_opt(
        "launch iteration i+1 before reading iteration i's tokens"))
    constant_batch: bool = dataclasses.field(default=False, metadata=_opt(
        "pad every iteration to B_dense tokens (NanoFlow's dense batch)"))
    admission: str | None = dataclasses.field(default=None, metadata=_opt(
        "predicted: admit only while every running request's expected final length fits "
        "the KV cache (NanoFlow's memory prediction), paced so the batch stays full; "
        "greedy: as soon as a prompt's pages are free; default: predicted on a GPU, greedy "
        "on the CPU", choices=ADMISSION))
    fixed_shapes: bool | None = dataclasses.field(default=None, metadata=_opt(
        "one row count (the B_dense step also at 5/8 of it: full_step_row_shapes) and "
        "page-table width, so every step shape (one per token bucket) compiles before "
        "serving; default: on a GPU (off on the CPU, where fixed rows cost logits for "
        "every row)"))
    fit_step_shapes: bool = dataclasses.field(default=True, metadata=_opt(
        "let a step's prefill tail wait one step where that launches it at the next "
        "smaller token count (fewer tokens wait than the larger count would pad, no more "
        "than go now): less padding where the batch is not full, as when the KV cache "
        "bounds it"))
    prefill_spread: int | None = dataclasses.field(default=None, metadata=_opt(
        "with fit-step-shapes, where the KV cache or the pace holds the batch below "
        "B_dense: the prompts left are spread over this many steps, each step launched "
        "at a compiled token count its prefill fills (not a new prompt at once, then "
        "decodes alone padded to the next count); 0: off; default: 8 on a GPU "
        "(bench/results/log/fp8.md §95), off on the CPU"))
    full_step_row_shapes: int = dataclasses.field(default=2, metadata=_opt(
        "with fixed shapes: row counts compiled for the B_dense step, 1 (the one row "
        "count) or 2 (also 5/8 of it, rounded up to 64: a steady state of half decodes "
        "and half prefill, ~1,030 rows of 2,048 at 128/128, runs its LM head and sampler "
        "on 1,280 rows; one more shape compiled at start)", choices=(1, 2)))
    min_token_bucket: int | None = dataclasses.field(default=None, metadata=_opt(
        "smallest token count a step is padded to (then powers of two up to B_dense, or "
        "steps of --token-bucket-step); default: 16 on a GPU or with fixed shapes, else 1 "
        "(the CPU, where every padding token costs its share of the matmuls and "
        "attention)"))
    min_row_bucket: int | None = dataclasses.field(default=None, metadata=_opt(
        "smallest row count (sequences) a step is padded to; default: 4 on a GPU, 1 on "
        "the CPU (each padding row costs logits over the vocabulary)"))
    token_bucket_step: int | None = dataclasses.field(default=None, metadata=_opt(
        "above this many tokens, a step is padded to a multiple of it rather than to the "
        "next power of two (B_dense or more: powers of two throughout); default: 256 on a "
        "GPU (fewer padding tokens where a decode batch is not a power of two, for 4 more "
        "step shapes at B_dense 2,048, compiled at start with fixed shapes; "
        "bench/results/log/fp8.md §94), 128 on the CPU (a 600-token prompt runs 640 "
        "tokens, not 1024), off on the CPU with fixed shapes"))
    seed: int = dataclasses.field(default=0, metadata=_opt(
        "seed of the per-request seeds of unseeded requests", cli=False))
    kv_cache_dtype: str = dataclasses.field(default="auto", metadata=_opt(
        "KV cache element type: auto (the model's dtype), bf16, or fp8 (e4m3 pages with "
        "per-kv-head scales: twice the pages per GB)", choices=KV_CACHE_DTYPES))
    tensor_parallel_size: int = dataclasses.field(default=1, metadata=_opt(
        "split the model over this many devices (shard_map over a 'tp' mesh axis)"))
    # KV reuse (names as vLLM's --enable-prefix-caching; sizes take K/M/G/T suffixes)
    enable_prefix_caching: bool = dataclasses.field(default=True, metadata=_opt(
        "share the KV pages of common prompt prefixes (automatic prefix caching)"))
    kv_offload_host_bytes: int = dataclasses.field(default=0, metadata=_opt(
        "copy finished requests' KV pages to this much host memory and load them back "
        "for a returning prefix (0: off)", parse="bytes"))
    kv_offload_dir: str | None = dataclasses.field(default=None, metadata=_opt(
        "also keep them in this directory (per model fingerprint), reused after a restart"))
    kv_offload_disk_bytes: int = dataclasses.field(default=16 << 30, metadata=_opt(
        "the disk tier's limit", parse="bytes"))
    step_cache: bool = dataclasses.field(default=True, metadata=_opt(
        "keep the compiled step executables beside jax's compile cache (none with "
        "--no-compile-cache), so a warm start loads them without tracing the step; a "
        "loaded step gives a fresh compile's tokens (measured: "
        "bench/results/log/engine_host.md)"))
    compile_threads: int | None = dataclasses.field(default=None, metadata=_opt(
        "with fixed shapes: step shapes compiled at once while warming up (the B_dense "
        "shape first, alone, so its GEMMs are autotuned on an idle GPU); default: half "
        "the host's cores, at most 8, on a GPU; 1 on the CPU"))
    async_dispatch: bool | None = dataclasses.field(default=None, metadata=_opt(
        "dispatch each step from a thread of its own (the GPU launches a step's kernels "
        "from the calling thread), so the engine thread reads the step before and forms "
        "the next batch meanwhile; default: on a GPU"))
    num_sms: int | None = dataclasses.field(default=None, metadata=_opt(
        "the device's SM count, which a plan's shares of the GPU are taken of; default: "
        "the device's own", cli=False))
    gc_freeze: bool = dataclasses.field(default=True, metadata=_opt(
        "run the engine loop with the objects that exist when it starts frozen out of "
        "Python's garbage collector (gc.freeze), so a full collection does not scan jax's "
        "and the model's objects between steps (nanojax/engine/gc_freeze.py)"))
    kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)

    def __post_init__(self):
        for name in ("page_size", "max_model_len", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("b_dense", "num_pages", "max_num_seqs", "min_token_bucket",
                     "min_row_bucket", "token_bucket_step", "compile_threads", "num_sms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be positive, got {v}")
        if self.prefill_spread is not None and self.prefill_spread < 0:
            raise ConfigError(f"prefill_spread must be 0 (off) or positive, "
                              f"got {self.prefill_spread}")
        if self.full_step_row_shapes not in (1, 2):
            raise ConfigError(f"full_step_row_shapes must be 1 or 2, got "
                              f"{self.full_step_row_shapes}")
        if not 0 < self.memory_utilization <= 1:
            raise ConfigError("memory_utilization must be in (0, 1], got "
                              f"{self.memory_utilization}")
        if self.admission is not None and self.admission not in ADMISSION:
            raise ConfigError(f"admission must be one of {ADMISSION}, got {self.admission!r}")

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)

    def dense_batch(self, on_gpu: bool | None = None, kv_tokens: int | None = None,
                    max_model_len: int | None = None) -> int:
        """b_dense, or the backend's default when it is not set (on_gpu None: the default
        backend's). A GPU's is NanoFlow's rule: the largest dense batch the KV cache keeps
        full. With requests of up to max_model_len tokens, half prompt and half output,
        kv_tokens hold kv_tokens / (max_model_len / 2) of them decoding at their mean
        context, and as many prompt tokens an iteration replace the ones that finish: a
        batch of 4 kv_tokens / max_model_len, in multiples of 256, at most GPU_B_DENSE
        (where the 8B's GEMMs are compute-bound on an H200); kv_tokens None (not sized
        yet): GPU_B_DENSE."""
        if self.b_dense is not None:
            return self.b_dense
        if on_gpu is None:
            import jax
            on_gpu = jax.default_backend() == "gpu"
        if not on_gpu:
            return CPU_B_DENSE
        if kv_tokens is None:
            return GPU_B_DENSE
        keeps_full = 4 * kv_tokens // (max_model_len or self.max_model_len)
        return max(256, min(GPU_B_DENSE, keeps_full // 256 * 256))

    def resolve(self, platform: "Platform", kv_tokens: int | None = None,
                max_model_len: int | None = None) -> "EngineConfig":
        """This configuration with every default that depends on where it runs filled in
        (nothing left None but num_pages and max_num_seqs, which the cache sizing sets):
        a GPU's are throughput-first (NanoFlow's dense batch, predicted admission, every
        step shape compiled at start, the dispatch on its own thread), the CPU's
        latency-first (a step pays for every padding token and row there). kv_tokens and
        max_model_len: the cache's size and the longest request, for the dense batch."""
        gpu = platform.gpu
        fixed = gpu if self.fixed_shapes is None else self.fixed_shapes
        return self.replace(
            b_dense=self.dense_batch(gpu, kv_tokens, max_model_len),
            admission=self.admission or ("predicted" if gpu else "greedy"),
            fixed_shapes=fixed,
            min_token_bucket=self.min_token_bucket or (16 if gpu or fixed else 1),
            min_row_bucket=self.min_row_bucket or (4 if gpu else 1),
            # steps padded to a multiple of 256 on a GPU above 256 tokens (a decode batch
            # of 600 and a short prefill run 768 tokens, not 1,024: GEMM work the padding
            # costs, against 4 more shapes compiled at start), of 128 on the CPU (each
            # bucket is one more shape compiled with fixed shapes: none there)
            token_bucket_step=self.token_bucket_step or (
                256 if gpu else None if fixed else 128),
            # a KV-bound batch's prompts spread over 8 steps, each at a compiled shape its
            # prefill fills (padding on the GPU's few shapes; the CPU's steps of 128 and
            # its latency-first defaults leave it off; without the fit to the step shapes,
            # or with a constant batch, there is nothing to fill: off)
            prefill_spread=0 if not self.fit_step_shapes or self.constant_batch else (
                (8 if gpu else 0) if self.prefill_spread is None else self.prefill_spread),
            # XLA's GPU compile is mostly single-threaded host work; the CPU's cores run
            # the model
            compile_threads=self.compile_threads or (
                max(1, min(8, platform.host_cores // 2)) if gpu else 1),
            async_dispatch=gpu if self.async_dispatch is None else self.async_dispatch,
            num_sms=self.num_sms or platform.num_sms)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
