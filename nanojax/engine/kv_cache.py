"""Paged KV cache: the page allocator, the device arrays, and capacity sizing.

Pages are [num_pages, KVH, page_size, D] per layer for k and for v: head-major inside a
page, so a decode kernel streams contiguous rows of one head. Their element type is the
model's or the one --kv-cache-dtype names (FP8 pages carry scales: layers/kv_fp8.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nanojax.config import ModelConfig
from nanojax.errors import ConfigError
from nanojax.layers.kv_fp8 import init_kv_layer


class OutOfPages(Exception):
    pass


class PageAllocator:
    """Free list of page ids; every allocated page belongs to exactly one sequence."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ConfigError(f"KV cache needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def init_kv_pages(cfg: ModelConfig, num_pages: int, page_size: int, sharding=None,
                  dtype=None):
    """One (k_pages, v_pages) pair per layer (a QuantizedKV for FP8); dtype None: the
    model's."""
    shape = (num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    dtype = jnp.dtype(dtype or cfg.dtype)
    make = lambda fn: jax.jit(fn, out_shardings=sharding)()  # noqa: E731
    return [init_kv_layer(shape, dtype, make) for _ in range(cfg.num_layers)]


@dataclasses.dataclass(frozen=True)
class CacheSizing:
    num_pages: int
    page_size: int
    max_num_seqs: int   # most sequences that may run at once (decodes)
    max_model_len: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size


def free_device_bytes(utilization: float = 0.9) -> int | None:
    """Bytes the KV cache may take on the first device, or None where unknown (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] * utilization) - int(stats.get("bytes_in_use", 0))


def size_cache(cfg: ModelConfig, page_size: int, max_model_len: int, b_dense: int,
               num_pages: int | None = None, memory_bytes: int | None = None,
               expected_context: int | None = None,
               kv_itemsize: int | None = None) -> CacheSizing:
    """NanoFlow sizes the decode batch from KV capacity: as many requests as fit at their
    average context (prompt + half the output), never more than B_dense. kv_itemsize: bytes
    per cached element (1 for FP8: twice the pages of bf16); None: the model's."""
    if num_pages is None:
        memory_bytes = memory_bytes if memory_bytes is not None else free_device_bytes()
        if memory_bytes is None:
            raise ConfigError("cannot measure device memory here: give num_pages")
        per_page = cfg.kv_bytes_per_token(kv_itemsize) * page_size
        num_pages = int(memory_bytes // per_page)
    if num_pages * page_size < max_model_len:
        raise ConfigError(f"KV cache of {num_pages} pages x {page_size} tokens cannot hold "
                          f"one request of max_model_len {max_model_len}")
    ctx = expected_context or max(1, max_model_len // 2)
    max_seqs = max(1, min(b_dense, num_pages * page_size // ctx))
    return CacheSizing(num_pages, page_size, max_seqs, max_model_len)
