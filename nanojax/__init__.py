"""nanojax: a throughput-first LLM serving engine in JAX (NanoFlow reimplementation)."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig"]


def __getattr__(name):  # lazy: importing nanojax must not import jax
    if name == "LLM":
        from nanojax.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from nanojax.engine.sampling import SamplingParams
        return SamplingParams
    if name in ("LLMEngine", "EngineConfig"):
        from nanojax.engine import llm_engine
        return getattr(llm_engine, name)
    raise AttributeError(name)
