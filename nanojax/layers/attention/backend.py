"""The attention interface between a decoder layer and whatever stores the KV cache (the
Protocols), and PagedAttention, the backend made of an append and an attend function that
the CPU (cpu_blocked.py) and Pallas (pallas.py) backends both are."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from nanojax.config import KernelConfig
from nanojax.layers.attention.append import append_kv
from nanojax.layers.attention.metadata import PagedMetadata


class Attention(Protocol):
    """What a decoder layer calls: store this step's keys and values, attend."""

    def __call__(self, q, k, v, kv_layer, meta, inv_freq: np.ndarray):
        """q: [T, H, D], k/v: [T, KVH, D] -> (out [T, H, D], new kv_layer)."""


class AttentionBackend(Attention, Protocol):
    """The engine's attention over the paged cache, in two halves (append, then attend)
    so that the nano-batch executor can run an attention nano-op that only reads. Its
    callers: the runner and scheduler (the prefill fields, width_free), the forwards
    (prepare, __call__), the executor and the profiler (append, attend_at, attend,
    decode_kernel and attend_with for a fused pair)."""

    # read-only (properties): a frozen dataclass such as PagedAttention conforms
    @property
    def prefill_block_q(self) -> int | None:
        """Query block of the chunked-prefill kernel, if it runs."""
        ...

    @property
    def prefill_max_seqs(self) -> int:
        """With it: most sequences prefilling in one iteration."""
        ...

    @property
    def width_free(self) -> bool:
        """attend's cost follows the longest context, not the table's width."""
        ...

    @property
    def decode_kernel(self) -> str | None:
        """The Pallas decode kernel attend picks from (KernelConfig.decode_kernel: "auto",
        "mosaic", ...); None: attend launches none (the pure-JAX backends)."""
        ...

    def append(self, k, v, kv_layer, meta, inv_freq):
        """RoPE on k, then k and v written into their pages -> the new kv_layer."""

    def attend(self, q, kv_layer, meta, inv_freq):
        """Attention of q over pages that already hold this step's keys. A padding
        token's row (neither a decode nor a prefill token) is unspecified, NaN included
        (the Pallas backend leaves it unwritten): only that row may depend on it."""

    def attend_at(self, share: float, num_sms: int, ctas_per_sm: int = 4) -> Callable:
        """attend limited to a share of the device's num_sms SMs (where the kernel has a
        bounded grid; else attend itself)."""

    def attend_with(self, decode_fn: Callable) -> Callable:
        """attend with decode_fn launched in place of its decode kernel, called with that
        kernel's arguments (the fused GEMM + attention pair, pipeline/fused.py); only
        where decode_kernel is not None."""

    def prepare(self, meta):
        """meta with what every layer's attend reads of it computed once per step, before
        the layers (the swap-AB decode kernel's longest-first order). A forward calls it on
        each batch (nano-batch) it attends."""


def _unprepared(meta):
    return meta  # nothing to share between the layers


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """An AttentionBackend from an append and an attend function. decode_kernel: the Pallas
    decode kernel attend runs (then attend also takes share/num_sms/ctas_per_sm, a bounded
    grid, and decode_fn, a launch in the kernel's place); None: a pure-JAX attend."""

    attend: Callable
    prefill_block_q: int | None = None
    append: Callable = append_kv
    prepare: Callable = _unprepared
    prefill_max_seqs: int = KernelConfig().prefill_max_seqs
    # attend's cost follows the batch's longest context, not the page table's width (it
    # loops over key blocks): the runner can then launch one width and compile less
    width_free: bool = False
    decode_kernel: str | None = None

    def attend_at(self, share: float, num_sms: int, ctas_per_sm: int = 4) -> Callable:
        if self.decode_kernel is not None and share < 1.0:
            return functools.partial(self.attend, share=share, num_sms=num_sms,
                                     ctas_per_sm=ctas_per_sm)
        return self.attend

    def attend_with(self, decode_fn: Callable) -> Callable:
        if self.decode_kernel is None:
            raise ValueError("this backend's attend launches no decode kernel to replace")
        return functools.partial(self.attend, decode_fn=decode_fn)

    def __call__(self, q, k, v, kv_layer, meta: PagedMetadata, inv_freq):
        kv_layer = self.append(k, v, kv_layer, meta, inv_freq)
        return self.attend(q, kv_layer, meta, inv_freq), kv_layer


if TYPE_CHECKING:  # mypy (.ci/run) checks that PagedAttention is an AttentionBackend
    _BACKEND: type[AttentionBackend] = PagedAttention
