"""nanojax: a throughput-first LLM serving engine in JAX (NanoFlow reimplementation)."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig", "KernelConfig"]


def __getattr__(name):  # lazy: importing nanojax must not import jax
    if name == "LLM":
        from nanojax.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from nanojax.engine.sampling import SamplingParams
        return SamplingParams
    if name == "LLMEngine":
        from nanojax.engine.llm_engine import LLMEngine
        return LLMEngine
    if name in ("EngineConfig", "KernelConfig"):
        from nanojax import config
        return getattr(config, name)
    raise AttributeError(name)
