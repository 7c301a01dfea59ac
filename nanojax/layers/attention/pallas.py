"""The GPU backend: the Pallas paged kernels (pallas_kernels/) behind the attention
interface. It picks the decode kernel, bounds its grid to a resource share, orders its
rows once a step, and sends prefill tokens to the chunked-prefill kernel."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp

from nanojax.config import KernelConfig
from nanojax.layers.attention.append import append_kv, append_kv_pallas
from nanojax.layers.attention.backend import PagedAttention
from nanojax.layers.attention.metadata import PagedMetadata
from nanojax.layers.kv_fp8 import is_fp8, kv_parts
from nanojax.layers.rotary import apply_rope


def _decode_kernel(name: str):
    """The paged decode kernel: Triton (pallas_kernels/decode_attention.py, any GPU), the
    Mosaic GPU swap-AB kernel (decode_attention_swapab.py, Hopper: keeps its bandwidth on
    a bounded grid) or the earlier Mosaic GPU row-tile kernel (decode_attention_mgpu.py)."""
    if name == "mosaic":
        from pallas_kernels.decode_attention_swapab import decode_attention_swapab
        return decode_attention_swapab
    if name == "mosaic-rows":
        from pallas_kernels.decode_attention_mgpu import decode_attention_mgpu
        return decode_attention_mgpu
    if name == "triton":
        from pallas_kernels.decode_attention import decode_attention_impl
        return decode_attention_impl
    raise ValueError(f"no decode kernel {name!r}")


def choose_decode_kernel(name: str, q, k_pages) -> str:
    """"auto": the Mosaic GPU swap-AB kernel on a Hopper or newer GPU when it takes the
    operands (16-bit, head dim % 64, page size % 8, group <= its column limit), else
    Triton: on the H200 it reads nearer copy bandwidth than Triton, on the full grid and
    more so on a share of it. Interpret mode (no GPU) gets Triton. FP8 pages go the same
    way ("mosaic-rows" reads none: Triton), the swap-AB kernel being the faster of the
    two on them too (bench/results/log/kernels.md)."""
    from pallas_kernels.decode_attention_swapab import unsupported
    if is_fp8(k_pages.dtype) and (name == "mosaic-rows"
                                  or name == "mosaic" and unsupported(q, k_pages)):
        return "triton"
    if name != "auto":
        return name
    from pallas_kernels.mosaic_gpu_support import on_hopper
    return "mosaic" if on_hopper() and unsupported(q, k_pages) is None else "triton"


def decode_programs(kernel: str, share: float | None, num_sms: int | None,
                    ctas_per_sm: int = 4):
    """A resource share as the decode kernel's persistent grid (None: its full grid).
    Triton: share x SMs x programs per SM; the Mosaic GPU kernels run one program per SM,
    so a share is whole SMs and leaves the others free."""
    if share is None or share >= 1.0:
        return None
    assert num_sms is not None, "a share needs the SM count it divides"
    per_sm = 1 if kernel.startswith("mosaic") else ctas_per_sm
    return max(1, round(share * num_sms * per_sm))


def decode_rows(meta: PagedMetadata):
    """The decode kernel's context length per row and its live row count: with query
    blocks the decodes (the other rows 0, the count num_decodes), without them every
    token at its own position (count None: all)."""
    if meta.prefill_blocks is None:
        return meta.positions + 1, None
    is_decode = jnp.arange(meta.positions.shape[0]) < meta.num_decodes
    return jnp.where(is_decode, meta.positions + 1, 0), meta.num_decodes


def prepare_pallas(meta: PagedMetadata, decode_kernel: str = "auto",
                   decode_longest_first: bool = True) -> PagedMetadata:
    """The Pallas backend's prepare: the swap-AB kernel's longest-first order, sorted once
    per step where that kernel may run (under "auto" also where it then does not: one
    unused sort). Sorted in each layer's stream region instead, it was one sort a layer,
    a visible share of the step (bench/results/log/kernels.md). The order serves either
    page type."""
    if decode_kernel not in ("auto", "mosaic") or not decode_longest_first:
        return meta
    from pallas_kernels.decode_attention_swapab import longest_first
    return dataclasses.replace(meta, decode_order=longest_first(*decode_rows(meta)))


def attend_pallas(q, kv_layer, meta: PagedMetadata, inv_freq, share: float | None = None,
                  num_sms: int | None = None, ctas_per_sm: int = 4, block_q: int = 16,
                  decode_kernel: str = "auto", decode_prefetch: bool | None = None,
                  decode_longest_first: bool = True, decode_fp8_query: bool = False,
                  interpret: bool = False, decode_fn: Callable | None = None):
    """GPU path: the Pallas paged kernels. share: the decode kernel's resource share of
    num_sms SMs (None: the device's, pallas_kernels/device.py). decode_fn: called in place
    of the chosen decode kernel, with its arguments (the pipeline's fused GEMM + attention
    launch, nanojax/pipeline/fused.py).

    Without query blocks every token is a row of the decode kernel with its own sequence's
    pages and a context that ends at its own position (causal for prefill chunks too, but
    each prefill token re-reads its whole context). With them (meta.prefill_blocks, made
    with the same block_q), the decode kernel serves the decode tokens and the
    chunked-prefill kernel the rest."""
    k_pages, v_pages, ks, vs = kv_parts(kv_layer)
    kernel = choose_decode_kernel(decode_kernel, q, k_pages)
    decode = _decode_kernel(kernel)
    if kernel == "triton":
        decode = functools.partial(decode, prefetch=decode_prefetch)
    if kernel == "mosaic" and decode_longest_first:
        decode = functools.partial(decode, longest_first_order=True, order=meta.decode_order)
    if ks is not None:  # FP8 pages (Triton or swap-AB, see choose_decode_kernel)
        decode = functools.partial(decode, k_scale=ks, v_scale=vs)
        if kernel == "mosaic" and decode_fp8_query:  # QK^T as an FP8 WGMMA
            decode = functools.partial(decode, fp8_query=True)
    if decode_fn is not None:
        decode = decode_fn
    if num_sms is None and share is not None:
        from pallas_kernels.device import device_sms
        num_sms = device_sms()
    num_programs = decode_programs(kernel, share, num_sms, ctas_per_sm)
    q = apply_rope(q, meta.positions, inv_freq)
    rows = meta.page_table[meta.seq_ids]
    lens, num_rows = decode_rows(meta)
    if meta.prefill_blocks is None:
        return decode(q, k_pages, v_pages, rows, lens, num_programs=num_programs,
                      interpret=interpret)
    from pallas_kernels.prefill_attention import in_place_unsupported, prefill_attention_impl
    if kernel == "mosaic" and decode_fn is None:  # the decodes come first: the swap-AB
        # kernel skips the other rows' (sequence, kv head) items (their outputs unwritten:
        # the prefill rows are written next, a padding token's row is read by nothing
        # that outlives its own row) instead of loading and storing them with no keys
        decode = functools.partial(decode, num_rows=num_rows)
    dec = decode(q, k_pages, v_pages, rows, lens, num_programs=num_programs,
                 interpret=interpret)
    prefill = functools.partial(prefill_attention_impl, q, k_pages, v_pages, meta.page_table,
                                meta.positions, meta.prefill_blocks, meta.prefill_slot,
                                block_q=block_q, k_scale=ks, v_scale=vs, interpret=interpret)
    if in_place_unsupported(q.shape[1], k_pages.shape[1], block_q) is None:
        return prefill(out=dec)  # the prefill rows written into the decode kernel's output
    is_decode = jnp.arange(q.shape[0]) < meta.num_decodes
    return jnp.where(is_decode[:, None, None], dec, prefill())


def pallas_backend(kernels: KernelConfig = KernelConfig()) -> PagedAttention:
    """The Pallas backend the KernelConfig describes: the decode kernel it names; with
    prefill_kernel, prefill tokens go to the chunked-prefill kernel in query blocks of
    prefill_block_q tokens (the runner builds them); fused_append writes the cache with
    the fused RoPE + append kernel."""
    block_q = kernels.prefill_block_q if kernels.prefill_kernel else None
    attend = functools.partial(attend_pallas, block_q=kernels.prefill_block_q,
                               decode_kernel=kernels.decode_kernel,
                               decode_prefetch=kernels.decode_prefetch,
                               decode_longest_first=kernels.decode_longest_first,
                               decode_fp8_query=kernels.decode_fp8_query,
                               interpret=kernels.interpret)
    append = (functools.partial(append_kv_pallas, interpret=kernels.interpret)
              if kernels.fused_append else append_kv)
    prepare = functools.partial(prepare_pallas, decode_kernel=kernels.decode_kernel,
                                decode_longest_first=kernels.decode_longest_first)
    return PagedAttention(attend, block_q, append, prepare=prepare,
                          prefill_max_seqs=kernels.prefill_max_seqs,
                          decode_kernel=kernels.decode_kernel)
