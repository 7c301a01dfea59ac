"""The per-iteration model forward, behind one small interface the engine calls
(`Forward`, below).

`UnrolledForward` runs the layers as straight-line code, which is what stream annotation
and the nano-batch executor need on the GPU. `ScanForward` stacks the layers and runs them
with lax.scan: one layer is compiled once. `LayerwiseForward` (the CPU's) also compiles
one layer, but dispatches it once per layer from Python with that layer's own weights.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from nanojax.config import KernelConfig, ModelConfig
from nanojax.engine.kv_cache import init_kv_pages
from nanojax.layers.attention import AttentionBackend, paged_attention, pallas_backend
from nanojax.layers.kv_fp8 import QuantizedKV, init_kv_layer, kv_parts, with_pages
from nanojax.models.llama import DecoderLayer, LlamaForCausalLM


class Forward(Protocol):
    """What the engine (scheduler, runner, tensor parallelism, the KV reuse) needs of a
    model forward. Implementations: UnrolledForward, ScanForward, LayerwiseForward (below),
    PipelineForward (the nano-batch executor), TensorParallelForward (parallel/tp.py) and
    MockForward (engine/mock_forward.py, a stand-in for tests and the host benchmark)."""

    cfg: ModelConfig  # the model's shape (a shard's, inside tensor parallelism)
    attention: AttentionBackend  # how the step appends to and reads the paged cache
    # batch positions no prefill chunk may straddle (the nano-batch executor's attention
    # cuts); () for a forward without nano-batches
    chunk_cuts: tuple[int, ...]
    kv_page_axis: int  # the page axis of the cache's paged arrays (prefix-cache copies)
    compiler_options: dict  # XLA options the jitted step compiles with
    # False: __call__ runs outside the step's jit, dispatching jitted pieces itself
    traced: bool
    num_traces: int  # compilations of such pieces (the runner's compile count); else 0

    # read-only (properties): TensorParallelForward's mesh is always a Mesh, and its
    # top_logprobs a method
    @property
    def mesh(self) -> Mesh | None:
        """The devices it runs over (tensor parallelism); None: one device."""
        ...

    @property
    def top_logprobs(self) -> Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] | None:
        """Top-k of vocab-sharded log-probabilities without gathering them (tensor
        parallelism); None: the sampler's own lax.top_k."""
        ...

    def layout(self, params, stack=jnp.stack):
        """The parameter tree restructured as prepare() places it (stack: np.stack to
        build it on the host)."""

    def for_shard(self, cfg: ModelConfig, tp_axis: str) -> "Forward":
        """This forward for one tensor-parallel shard of shape cfg, run inside shard_map."""

    def prepare(self, params):
        """Parameters as this forward wants them on device."""

    def init_kv(self, num_pages: int, page_size: int, dtype=None):
        """The paged KV cache in this forward's layout (dtype: the cache's element type,
        FP8 included; None: the model's)."""

    def __call__(self, params, tokens, kv, meta, logit_idx):
        """One iteration over the packed tokens -> (logits [R, V] f32 of the rows
        logit_idx, new kv)."""


class UnrolledForward:
    chunk_cuts: tuple[int, ...] = ()
    mesh: Mesh | None = None
    top_logprobs: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] | None = None
    # steps of up to this many rows read GGUF blocks (LayerwiseForward's; default_forward
    # sets it on every forward it builds)
    quant_max_rows: int
    # the runner traces __call__ inside its jitted step; False: __call__ dispatches jitted
    # pieces itself (LayerwiseForward), so the runner jits the rest of the step apart
    traced = True
    num_traces = 0
    kv_page_axis = 0  # of every paged cache array: a list of per-layer [P, KVH, ps, D]

    # tp_axis: run as one tensor-parallel shard inside shard_map (nanojax/parallel/tp.py);
    # cfg is then the shard's shape
    def __init__(self, cfg: ModelConfig, attention: AttentionBackend = paged_attention,
                 tp_axis: str | None = None):
        self.cfg = cfg
        self.attention = attention
        self.tp_axis = tp_axis
        self.compiler_options: dict = {}
        self.grouped_gemm = "auto"  # an MoE FFN's expert GEMMs (KernelConfig.grouped_gemm)
        self.act_quant = "xla"  # FP8 projections' input quantization (KernelConfig.act_quant)

    @property
    def model(self) -> LlamaForCausalLM:
        """The model with this forward's kernel choices, which are set after __init__
        (default_forward): built when used, so its layers never keep stale ones."""
        return LlamaForCausalLM(self.cfg, tp_axis=self.tp_axis,
                                grouped_gemm=self.grouped_gemm, act_quant=self.act_quant)

    def layer(self, matmul=None, grouped_gemm: str | None = None) -> DecoderLayer:
        """A decoder layer whose GEMMs are `matmul` and expert GEMMs `grouped_gemm` (None:
        this forward's)."""
        return DecoderLayer(self.cfg, matmul=matmul, reduce=self.model.reduce,
                            grouped_gemm=grouped_gemm or self.grouped_gemm,
                            act_quant=self.act_quant)

    def layout(self, params, stack=jnp.stack):
        """The parameter tree restructured as prepare() places it (without the CPU's
        quantized blocks, which only LayerwiseForward runs)."""
        return {k: v for k, v in params.items() if k != "quant"}

    def for_shard(self, cfg: ModelConfig, tp_axis: str):
        """This forward for one tensor-parallel shard of shape cfg (inside shard_map)."""
        new = copy.copy(self)
        new.cfg, new.tp_axis = cfg, tp_axis
        return new

    def prepare(self, params):
        return jax.device_put(self.layout(params))

    def init_kv(self, num_pages: int, page_size: int, dtype=None):
        return init_kv_pages(self.cfg, num_pages, page_size, dtype=dtype)

    def __call__(self, params, tokens, kv, meta, logit_idx):
        # AttentionBackend.prepare: what every layer's attention reads, once a step
        return self.model.apply(params, tokens, kv, self.attention.prepare(meta),
                                self.attention, logit_indices=logit_idx)


class ScanForward(UnrolledForward):
    kv_page_axis = 1  # layers stacked first: [L, P, KVH, ps, D]

    def layout(self, params, stack=jnp.stack):
        p = dict(params["params"])
        layers = [p.pop(f"layers_{i}") for i in range(self.cfg.num_layers)]
        stacked = jax.tree_util.tree_map(lambda *xs: stack(xs), *layers)
        return {"rest": {"params": p}, "layers": stacked}

    def init_kv(self, num_pages: int, page_size: int, dtype=None):
        c = self.cfg
        shape = (c.num_layers, num_pages, c.num_kv_heads, page_size, c.head_dim)
        return init_kv_layer(shape, dtype or c.dtype)  # every layer's, stacked

    def __call__(self, params, tokens, kv, meta, logit_idx):
        model, layer, inv_freq = self.model, self.layer(), self.model.inv_freq
        rest = params["rest"]
        x = model.apply(rest, tokens, method=LlamaForCausalLM.embed_tokens)
        # The cache rides in the scan's carry as one flat page pool [L * P, ...], layer l
        # owning pages [l * P, (l + 1) * P): each layer's append is an in-place scatter and
        # its attention a gather at shifted page ids. Scanned as xs/ys instead, every step
        # copied the whole cache every step.
        k_all, v_all, k_scale, v_scale = kv_parts(kv)
        meta = self.attention.prepare(meta)
        n_layers, n_pages = k_all.shape[:2]
        flat = (k_all.reshape(-1, *k_all.shape[2:]), v_all.reshape(-1, *v_all.shape[2:]))
        page_size = k_all.shape[3]

        def body(carry, xs):
            x, (k_flat, v_flat) = carry
            layer_params, i, scales = xs
            base = i * n_pages
            meta_i = dataclasses.replace(
                meta, page_table=meta.page_table + base,
                slot_mapping=jnp.where(meta.slot_mapping >= 0,
                                       meta.slot_mapping + base * page_size, -1))
            kv_layer = (k_flat, v_flat) if scales is None else QuantizedKV(
                k_flat, v_flat, *scales)
            # flax types apply's result as out or (out, variables): mypy takes the tuple
            x, kv_layer = layer.apply({"params": layer_params}, x, kv_layer, meta_i,  # type: ignore[assignment]
                                      self.attention, inv_freq)
            return (x, kv_parts(kv_layer)[:2]), None

        scales = None if k_scale is None else (k_scale, v_scale)
        (x, (k_flat, v_flat)), _ = jax.lax.scan(
            body, (x, flat), (params["layers"], jnp.arange(n_layers), scales))
        kv = with_pages(kv, k_flat.reshape(k_all.shape), v_flat.reshape(v_all.shape))
        return model.apply(rest, x[logit_idx], method=LlamaForCausalLM.logits), kv


# XLA's CPU GEMMs by rows (tokens, or logits rows for the LM head): its own GEMV for one,
# YNNPACK by default. Eigen is the faster for small steps on a 2-core CPU, so steps of
# up to 16 rows turn YNNPACK off (measured: bench/results/log/cpu.md)
SMALL_GEMM_ROWS = 16
EIGEN_GEMMS = {"xla_cpu_experimental_ynn_fusion_type": ""}


class LayerwiseForward(UnrolledForward):
    """One jitted layer, called once per layer from Python (embedding and LM head are two
    more calls): what the scan compiles, without its weight copies. Inside a scan each
    layer's weights are a dynamic slice of the stacked arrays, which XLA's CPU backend
    copies before every dot (a one-token step reads the weights from memory twice);
    straight-line layers read them in place but compile for much longer (measured:
    bench/results/log/cpu.md). Here each call gets its layer's arrays as they are, and its cache pages are
    donated, so appends stay in place. Parameters and cache are UnrolledForward's (the
    flax tree, a list of per-layer pages). Called inside a trace (tensor parallelism's
    shard_map, the step benchmark) the calls inline into straight-line layers."""

    traced = False

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend = paged_attention,
                 tp_axis: str | None = None, small_gemms: str = "eigen"):
        super().__init__(cfg, attention, tp_axis)
        self.small_gemms = small_gemms  # KernelConfig.cpu_small_gemms
        self.quant_max_rows = 1  # KernelConfig.cpu_quant_max_rows
        self.num_traces = 0  # layer compilations (the runner's compile count)
        self._jits: dict = {}

    def for_shard(self, cfg: ModelConfig, tp_axis: str):
        """A tensor-parallel shard runs traced inside shard_map: the scan, whose compile
        stays that of one layer."""
        shard = ScanForward(cfg, self.attention, tp_axis)
        shard.grouped_gemm, shard.compiler_options = self.grouped_gemm, self.compiler_options
        shard.act_quant = self.act_quant
        return shard

    def layout(self, params, stack=jnp.stack):
        return params  # with a `quant` collection where the engine kept GGUF blocks

    def _variables(self, params, rows: int, layer: str | None = None) -> dict:
        """Flax variables for a call of `rows` rows: the quantized blocks too where there
        are some and the rows are few (layers/quant.py)."""
        quant = params.get("quant") if rows <= self.quant_max_rows else None
        if layer is None:  # the embedding and LM head: the blocks outside the layers
            v = {"params": params["params"]}
            top = {k: q for k, q in (quant or {}).items() if not k.startswith("layers_")}
            return {**v, "quant": top} if top else v
        v = {"params": params["params"][layer]}
        return {**v, "quant": quant[layer]} if quant and layer in quant else v

    def _jit(self, name: str, fn, rows: int, **kw):
        """fn jitted, with Eigen's GEMMs where the step's GEMMs have few rows (a jit's
        compiler options hold for all its shapes: two jits)."""
        small = self.small_gemms == "eigen" and rows <= SMALL_GEMM_ROWS
        if (name, small) not in self._jits:
            options = {**self.compiler_options, **(EIGEN_GEMMS if small else {})}
            self._jits[name, small] = jax.jit(fn, compiler_options=options or None, **kw)
        return self._jits[name, small]

    def __call__(self, params, tokens, kv, meta, logit_idx):
        model, layer, inv_freq = self.model, self.layer(), self.model.inv_freq

        def run_layer(variables, x, kv_layer, meta):
            self.num_traces += 1  # once per trace, i.e. per compiled shape
            return layer.apply(variables, x, kv_layer, meta, self.attention, inv_freq)

        t, r = tokens.shape[0], logit_idx.shape[0]
        embed = self._jit("embed", lambda p, t: model.apply(
            p, t, method=LlamaForCausalLM.embed_tokens), t)
        one = self._jit("layer", run_layer, t, donate_argnums=(2,))
        logits = self._jit("logits", lambda p, x, i: model.apply(
            p, x[i], method=LlamaForCausalLM.logits), r)
        x = embed({"params": params["params"]}, tokens)
        kv = list(kv)
        for i in range(self.cfg.num_layers):
            x, kv[i] = one(self._variables(params, t, f"layers_{i}"), x, kv[i], meta)
        return logits(self._variables(params, r), x, logit_idx), kv


# what XLA captures into command buffers when KernelConfig.command_buffers is on: its own
# default set (kernels, cuBLAS / cuDNN calls, custom calls that declare themselves safe)
COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"


def gpu_compiler_options(kernels: KernelConfig, backend: str | None = None,
                         side_streams: bool = False) -> dict:
    """XLA options of the step that the KernelConfig names (GPU only; backend: None, the
    default one). side_streams: the step places regions on other streams, where command
    buffers stay off (XLA chains a command buffer's async regions serially)."""
    if (backend or jax.default_backend()) != "gpu":
        return {}
    out: dict = {}
    if not kernels.merge_dots:
        out["xla_gpu_dot_merger_threshold_mb"] = 0
    # off is said explicitly: XLA's own default has them on (the CLI's XLA_FLAGS turn
    # them off process-wide, an LLM built in Python would not)
    on = kernels.command_buffers and not side_streams
    out["xla_gpu_enable_command_buffer"] = COMMAND_BUFFER_TYPES if on else ""
    return out


def default_forward(cfg: ModelConfig, kernels: KernelConfig = KernelConfig()) -> Forward:
    """GPU: straight-line layers with the Pallas kernels the KernelConfig names; CPU:
    per-layer calls, pure JAX."""
    fwd = (UnrolledForward(cfg, attention=pallas_backend(kernels))
           if jax.default_backend() == "gpu"
           else LayerwiseForward(cfg, small_gemms=kernels.cpu_small_gemms))
    fwd.grouped_gemm = kernels.grouped_gemm
    fwd.act_quant = kernels.act_quant
    fwd.quant_max_rows = kernels.cpu_quant_max_rows
    fwd.compiler_options = {**fwd.compiler_options, **gpu_compiler_options(kernels)}
    return fwd


if TYPE_CHECKING:  # mypy (.ci/run) checks that each forward here is a Forward
    _FORWARDS: tuple[type[Forward], ...] = (UnrolledForward, ScanForward, LayerwiseForward)
