"""Model configuration: one dataclass, read from HF config.json, GGUF metadata or a named shape."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nanojax.errors import ConfigError

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a LLaMA-family decoder (LLaMA 2/3, SmolLM, Qwen2)."""

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
    dtype: str = "bfloat16"
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * f + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head

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
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size}

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
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ConfigError(f"unsupported model_type {model_type!r} in config.json "
                              "(supported: llama, qwen2, mistral)")
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
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                dtype=dtype, architecture=model_type,
                bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos)
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e}") from None


# Named shapes for shape-only benchmarks and tests (no download, random weights).
NAMED_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                        max_position_embeddings=1024, dtype="float32"),
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
}


def named_shape(name: str, dtype: str | None = None) -> ModelConfig:
    if name not in NAMED_SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; known: {sorted(NAMED_SHAPES)}")
    cfg = NAMED_SHAPES[name]
    return cfg.replace(dtype=dtype) if dtype else cfg
