"""Tensor parallelism (Megatron-style) through shard_map over a mesh axis `tp`.

Each device holds one shard of every projection, the paged KV cache of its KV heads and a
contiguous slice of the vocabulary:
  * q/k/v and gate/up are column-parallel (weights [in, out] split on out),
  * o and down are row-parallel (split on in); their partial outputs are summed by one
    psum per block (DecoderLayer.reduce),
  * KV heads are replicated when TP exceeds their count (as vLLM does): shard r holds KV
    head r // (TP / KVH), the one its query heads read,
  * the embedding and the LM head are vocab-parallel (the vocabulary padded to a multiple
    of TP); logits leave shard_map split on the vocabulary and the sampler runs on them
    under GSPMD: argmax, log-softmax and the chosen logprob reduce per shard, then
    across; the 20 top logprobs come from each shard's top 20 (top_logprobs); only the
    top-k/top-p sort, when a row asks for it, gathers whole rows.
Inside shard_map the model is the plain one built with the shard's shape
(`TPLayout.shard_config`), so the TP=1 path is untouched: nothing here runs at TP=1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nanojax.config import ModelConfig
from nanojax.errors import ConfigError, UnsupportedError

TP_AXIS = "tp"
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head",
           "shared_gate_proj", "shared_up_proj")  # (an MoE block's shared expert)
_ROW = ("o_proj", "down_proj", "embed", "shared_down_proj")  # embed: split on vocab rows
KV_HEAD_AXIS = -3  # pages [..., num_pages, KVH, page_size, D]


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How a model of shape `cfg` splits over `tp` devices."""

    cfg: ModelConfig
    tp: int

    def __post_init__(self):
        c, tp = self.cfg, self.tp
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if c.num_heads % tp:
            raise ConfigError(f"num_heads ({c.num_heads}) is not divisible by "
                              f"tensor_parallel_size ({tp})")
        if tp <= c.num_kv_heads and c.num_kv_heads % tp:
            raise ConfigError(f"num_kv_heads ({c.num_kv_heads}) is not divisible by "
                              f"tensor_parallel_size ({tp})")
        if tp > c.num_kv_heads and tp % c.num_kv_heads:
            raise ConfigError(f"tensor_parallel_size ({tp}) exceeds num_kv_heads "
                              f"({c.num_kv_heads}) and is not a multiple of it, so KV heads "
                              "cannot be replicated evenly")
        if tp > 1 and c.quantization == "fp8-block":  # its scales' blocks would split too
            raise UnsupportedError("fp8-block weights run at tensor_parallel_size 1; "
                                   "quantization 'fp8' (per channel) shards")
        for field in ("intermediate_size", "moe_intermediate_size",
                      "shared_expert_intermediate_size"):  # FFN widths split over shards
            if getattr(c, field) % tp:
                raise ConfigError(f"{field} ({getattr(c, field)}) is not divisible by "
                                  f"tensor_parallel_size ({tp})")

    @property
    def kv_repeat(self) -> int:
        """How many shards hold each KV head."""
        return max(1, self.tp // self.cfg.num_kv_heads)

    @property
    def padded_vocab(self) -> int:
        return -(-self.cfg.vocab_size // self.tp) * self.tp

    @property
    def shard_config(self) -> ModelConfig:
        c, tp = self.cfg, self.tp
        return c.replace(num_heads=c.num_heads // tp,
                         num_kv_heads=c.num_kv_heads * self.kv_repeat // tp,
                         intermediate_size=c.intermediate_size // tp,
                         moe_intermediate_size=c.moe_intermediate_size // tp,
                         shared_expert_intermediate_size=c.shared_expert_intermediate_size // tp,
                         vocab_size=self.padded_vocab // tp)

    def transform(self, params, xp=jnp):
        """The model's parameter tree -> the tree the shards split evenly: KV heads
        repeated kv_repeat times (adjacent copies), the vocabulary padded with zeros.
        xp: numpy for host arrays, jax.numpy inside jit."""
        c, r, pad = self.cfg, self.kv_repeat, self.padded_vocab - self.cfg.vocab_size
        p = dict(params["params"])
        if pad:
            p["embed"] = {"embedding": xp.pad(p["embed"]["embedding"], ((0, pad), (0, 0)))}
            if "lm_head" in p:
                p["lm_head"] = {"kernel": xp.pad(p["lm_head"]["kernel"], ((0, 0), (0, pad)))}
        if r > 1:
            def repeat(a):  # [..., KVH * D] -> [..., KVH * r * D]
                lead = a.shape[:-1]
                a = a.reshape(*lead, c.num_kv_heads, 1, c.head_dim)
                a = xp.broadcast_to(a, (*lead, c.num_kv_heads, r, c.head_dim))
                return a.reshape(*lead, c.num_kv_heads * r * c.head_dim)
            def repeat_rows(a):  # an FP8 weight [..., KVH * D, in]: its rows
                return xp.swapaxes(repeat(xp.swapaxes(a, -1, -2)), -1, -2)
            for i in range(c.num_layers):
                layer = dict(p[f"layers_{i}"])
                for name in ("k_proj", "v_proj"):
                    layer[name] = {k: repeat_rows(v) if k == "weight" else
                                   v if k == "input_scale" else repeat(v)
                                   for k, v in layer[name].items()}
                p[f"layers_{i}"] = layer
        return {"params": p}


def param_spec(path, ndim: int) -> P:
    """The PartitionSpec of a parameter from its tree path (stacked layers included:
    the split axis is counted from the end). An FP8 projection's weight is [out, in]
    (layers/fp8.py): its axes are the other way round, its scales follow `out`."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names, leaf = set(keys), keys[-1] if keys else None
    column, row = bool(names & set(_COLUMN)), bool(names & set(_ROW))
    axis = None
    if leaf == "input_scale" or (leaf == "weight_scale" and row):
        axis = None  # one scale per tensor / per output channel of a row-split weight
    elif leaf == "weight_scale":
        axis = ndim - 1
    elif leaf == "weight" and (column or row):
        axis = ndim - 2 if column else ndim - 1
    elif column:
        axis = ndim - 1
    elif row and ndim >= 2:
        axis = ndim - 2
    spec = [None] * ndim
    if axis is not None:
        spec[axis] = TP_AXIS
    return P(*spec)


def make_mesh(tp: int, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < tp:
        raise ConfigError(f"tensor_parallel_size {tp} needs {tp} devices; "
                          f"{len(devices)} {jax.default_backend()} device(s) available")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def shardings_for(tree, mesh: Mesh, even_only: bool = False):
    """NamedShardings by param_spec for a tree of arrays or ShapeDtypeStructs; with
    even_only, an axis that does not split evenly stays replicated."""
    tp = mesh.shape[TP_AXIS]

    def one(path, x):
        spec = param_spec(path, len(x.shape))
        if even_only and any(s and x.shape[i] % tp for i, s in enumerate(spec)):
            spec = P()
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, tree)


def model_shardings(cfg: ModelConfig, tp: int):
    """Shardings of the model's own parameter tree, for loaders (random init, orbax
    restore) to create each array in its shards (axes that do not split evenly, e.g. an
    odd vocabulary, stay replicated until prepare() pads them)."""
    from nanojax.models import param_shapes
    TPLayout(cfg, tp)
    return shardings_for(param_shapes(cfg), make_mesh(tp), even_only=True)


def place_host(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array into its shards (each device gets only its slice; also across
    processes, where every process holds the same host array)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


class TensorParallelForward:
    """The Forward interface (engine/forward.py) over a `tp` mesh: the base forward, built
    for one shard's shape, runs inside shard_map."""

    def __init__(self, base, tp: int, devices=None):
        self.tp_layout = TPLayout(base.cfg, tp)
        self.cfg = base.cfg
        self.tp = tp
        self.mesh = make_mesh(tp, devices)
        self.inner = base.for_shard(self.tp_layout.shard_config, TP_AXIS)
        self.attention = base.attention
        self.chunk_cuts = base.chunk_cuts
        self.kv_page_axis = base.kv_page_axis
        self.compiler_options = base.compiler_options
        self.traced, self.num_traces = True, 0  # the shard runs traced inside shard_map

    def layout(self, params, stack=jnp.stack):
        """The parameter tree as prepare() places it (the shards' layout, unsharded)."""
        return self.inner.layout(self.tp_layout.transform(params), stack=stack)

    def for_shard(self, cfg, tp_axis: str):
        raise UnsupportedError("a tensor-parallel forward is not split again")

    # ---- placement -------------------------------------------------------------------
    def _target(self, params):
        return jax.eval_shape(lambda p: self.inner.layout(self.tp_layout.transform(p)), params)

    def prepare(self, params):
        shardings = shardings_for(self._target(params), self.mesh)
        leaves = jax.tree_util.tree_leaves(params)
        target = jax.tree_util.tree_leaves(shardings)
        same_tree = (jax.tree_util.tree_structure(params)
                     == jax.tree_util.tree_structure(shardings)
                     and all(x.shape == t.shape for x, t in
                             zip(leaves, jax.tree_util.tree_leaves(self._target(params)))))
        if same_tree and all(isinstance(x, jax.Array) for x in leaves):
            # nothing to pad, repeat or stack (e.g. a 70B shape at TP 2 or 8 on the GPU):
            # each array only moves to its sharding, a no-op where the loader made it so,
            # so the weights never exist twice
            return jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(params),
                [jax.device_put(x, s) for x, s in zip(leaves, target)])
        if all(isinstance(x, jax.Array) for x in leaves):
            # already on devices (sharded by the loader): reshaped there, never gathered
            f = jax.jit(lambda p: self.inner.layout(self.tp_layout.transform(p)),
                        out_shardings=shardings)
            return f(params)
        host = self.inner.layout(self.tp_layout.transform(
            jax.tree_util.tree_map(np.asarray, params), np), stack=np.stack)
        return jax.tree_util.tree_map(place_host, host, shardings)

    def init_kv(self, num_pages: int, page_size: int, dtype=None):
        local = jax.eval_shape(lambda: self.inner.init_kv(num_pages, page_size, dtype))

        def zeros(x):
            shape = list(x.shape)
            shape[KV_HEAD_AXIS] *= self.tp
            sharding = NamedSharding(self.mesh, _kv_spec(x))
            return jax.jit(lambda: jnp.zeros(shape, x.dtype), out_shardings=sharding)()
        return jax.tree_util.tree_map(zeros, local)

    # ---- the step --------------------------------------------------------------------
    def __call__(self, params, tokens, kv, meta, logit_idx):
        # the specs follow from the trees' paths and ranks, as prepare() and init_kv() made them
        param_specs = jax.tree_util.tree_map_with_path(lambda p, x: param_spec(p, x.ndim),
                                                       params)
        kv_specs = jax.tree_util.tree_map(_kv_spec, kv)
        f = jax.shard_map(self.inner, mesh=self.mesh,
                          in_specs=(param_specs, P(), kv_specs, P(), P()),
                          out_specs=(P(None, TP_AXIS), kv_specs), check_vma=False)
        logits, kv = f(params, tokens, kv, meta, logit_idx)
        return logits[:, :self.cfg.vocab_size], kv


    def top_logprobs(self, logprobs, k: int):
        """lax.top_k over vocab-sharded rows [R, V] without gathering them: each device
        takes its shard's top k, the k x TP candidates are gathered and the top k of those
        taken. lax.top_k puts equal values in index order and the candidates come in
        shard (index) order, so values and ids equal one top_k over the whole row."""
        v = self.cfg.vocab_size
        if v % self.tp:  # an uneven vocabulary: GSPMD's own (gathering) top_k
            return jax.lax.top_k(logprobs, k)
        local_v = v // self.tp

        def shard(lp):
            kk = min(k, local_v)
            vals, ids = jax.lax.top_k(lp, kk)
            ids = ids + jax.lax.axis_index(TP_AXIS) * local_v
            vals = jax.lax.all_gather(vals, TP_AXIS, axis=1, tiled=True)
            ids = jax.lax.all_gather(ids, TP_AXIS, axis=1, tiled=True)
            top, pick = jax.lax.top_k(vals, k)
            return top, jnp.take_along_axis(ids, pick, axis=-1)
        return jax.shard_map(shard, mesh=self.mesh, in_specs=P(None, TP_AXIS),
                             out_specs=P(), check_vma=False)(logprobs)


def _kv_spec(x) -> P:
    s = [None] * len(x.shape)
    s[KV_HEAD_AXIS] = TP_AXIS
    return P(*s)


def sharded_forward(cfg: ModelConfig, forward, tp: int):
    """The engine's forward at tensor parallelism tp (the default forward if None) and the
    shape one device's KV cache is sized by."""
    from nanojax.engine.forward import default_forward
    if tp == 1:
        return forward, cfg
    fwd = TensorParallelForward(forward or default_forward(cfg), tp)
    return fwd, fwd.tp_layout.shard_config
