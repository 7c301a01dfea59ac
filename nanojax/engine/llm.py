"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses

from tqdm.auto import tqdm

from nanojax.config import EngineConfig
from nanojax.engine.llm_engine import LLMEngine
from nanojax.engine.outputs import RequestOutput
from nanojax.engine.sampling import SamplingParams
from nanojax.models.bundle import ModelBundle, quantize_bundle
from nanojax.plugins import model_loader


class LLM:
    """model: a name, path or `random:<shape>` (loaded here, straight into its shards under
    tensor parallelism), or a loaded ModelBundle. The engine's options come as an
    EngineConfig (`config`) or as its fields (`b_dense=...`), not both. quantization="fp8"
    runs the dense projections in FP8 (W8A8, weights quantized at load; vLLM's flag).
    generation_config "auto": generate() without sampling params samples as the model's
    generation_config.json says (get_default_sampling_params), as vLLM's LLM; "vllm":
    SamplingParams()'s defaults."""

    def __init__(self, model: str | ModelBundle = "smollm2-135m", dtype: str | None = None,
                 cache_dir=None, forward=None, config: EngineConfig | None = None,
                 quantization: str | None = None, generation_config: str = "auto",
                 **engine_kw):
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got "
                             f"{generation_config!r}")
        if config is not None and engine_kw:
            raise ValueError(f"give either config or engine options, not both "
                             f"({sorted(engine_kw)})")
        config = config or EngineConfig(**engine_kw)
        if isinstance(model, ModelBundle):
            bundle = quantize_bundle(model, quantization)
        else:
            bundle = model_loader().load_model(
                model, dtype=dtype, cache_dir=cache_dir,
                tensor_parallel_size=config.tensor_parallel_size, quantization=quantization)
        self.engine = LLMEngine(bundle, config, forward=forward)
        self.tokenizer = bundle.tokenizer
        # the model's recommended sampling (generation_config.json), keyed by field
        self.sampling_defaults = (dict(bundle.sampling_defaults)
                                  if generation_config == "auto" else {})

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended sampling where it has one."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists. Returns one
        output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or self.get_default_sampling_params()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        # only the finished outputs are returned: none made per token on the way
        ids = [self.engine.add_request(p, dataclasses.replace(sp, output_kind="final_only"))
               for p, sp in zip(prompts, plist)]
        with tqdm(total=len(ids), desc="generating", unit="req",
                  disable=not use_tqdm or len(ids) < 2) as bar:
            done = self.engine.run_to_completion(bar)
        outs = []
        for rid, prompt in zip(ids, prompts):
            out = done[rid]
            out.prompt = prompt if isinstance(prompt, str) else None
            outs.append(out)
        return outs
