"""Paged KV cache: the page allocator, the device arrays, and capacity sizing.

Pages are [num_pages, KVH, page_size, D] per layer for k and for v: head-major inside a
page, so a decode kernel streams contiguous rows of one head. Their element type is the
model's or the one --kv-cache-dtype names (FP8 pages carry scales: layers/kv_fp8.py).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp

from nanojax.config import ModelConfig
from nanojax.errors import ConfigError
from nanojax.layers.kv_fp8 import init_kv_layer


class OutOfPages(Exception):
    pass


class PageAllocator:
    """Page ids with reference counts, and the GPU prefix cache's page index.

    A page is in use (refcount > 0, owned or shared read-only by running sequences), or
    free. A free page that holds a full page of some prefix keeps its hash (cached-free):
    a later request with that prefix takes it back (`ref`) instead of recomputing it. New
    pages come from plain free pages first, then from cached-free pages least recently
    freed first, which drops their hash (eviction). With no page ever registered this is
    a plain free list.

    A hold (`hold`, `release`) is a reference the KV offload takes on a page queued for
    its copy out, so that the page is not handed out, and overwritten, before that copy is
    dispatched. Holds are not uses: a page that only holds keep is free (it joins the free
    lists when its last sequence lets go, in the same order as without holds, and counts
    in num_free, so the scheduler admits and preempts as if no page were held); only
    handing it out must wait, so `allocate` first calls `reclaim` (the offloader's forced
    flush: it dispatches the copies and releases every hold) when it would take a held
    page."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ConfigError(f"KV cache needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._plain = list(range(num_pages - 1, -1, -1))   # free, no hash; pop() = lowest
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.refcount = [0] * num_pages  # references: sequences' and holds
        self._hash_of: dict[int, bytes] = {}    # page -> its prefix hash (cached pages)
        self._page_of: dict[bytes, int] = {}    # prefix hash -> page
        self._holds: dict[int, int] = {}        # page -> holds among its references
        # releases every hold: set by whoever takes them
        self.reclaim: collections.abc.Callable[[], None] | None = None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages allocate() can hand out: plain free and cached-free ones (held or not)."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages some sequence references (what the KV usage gauge reports)."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    @property
    def num_held(self) -> int:
        """Pages with a hold on them (queued for the KV offload's copy out)."""
        return len(self._holds)

    def is_free(self, page: int) -> bool:
        """Whether no sequence references the page (it counts in num_free)."""
        return self.refcount[page] == self._holds.get(page, 0)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        if self._holds and self._takes_held(n):
            if self.reclaim is None:
                raise RuntimeError("a held page is needed and nothing can release it")
            self.reclaim()
            if self._holds and self._takes_held(n):
                raise RuntimeError(f"reclaim left {self.num_held} pages held")
        pages = []
        for _ in range(n):
            if self._plain:
                p = self._plain.pop()
            else:  # evict the least recently freed cached page
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(p)]
                self.num_evictions += 1
            self.refcount[p] = 1
            pages.append(p)
        return pages

    def _takes_held(self, n: int) -> bool:
        """Whether the next n pages allocate() hands out include a held one."""
        held = self._holds
        plain = self._plain[max(0, len(self._plain) - n):]
        return (any(p in held for p in plain) or
                any(p in held for p in itertools.islice(self._evictable, n - len(plain))))

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page. Give a sequence's pages tail first: cached
        pages are evicted in the order they are freed, so a prefix outlives its tail."""
        for p in pages:
            held = self._holds.get(p, 0)
            if self.refcount[p] <= held:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self.refcount[p] -= 1
            if self.refcount[p] == held:  # free now (if held: handed out after a reclaim)
                if p in self._hash_of:
                    self._evictable[p] = None
                else:
                    self._plain.append(p)

    # ---- holds (the KV offload's copies out) ----------------------------------------------
    def hold(self, page: int) -> None:
        """One more reference to an in-use page, kept until `release`: allocate() does not
        hand the page out while it has one (see the class docstring)."""
        if self.refcount[page] <= 0:
            raise RuntimeError(f"page {page} is not in use: nothing to hold")
        self.refcount[page] += 1
        self._holds[page] = self._holds.get(page, 0) + 1

    def release(self, pages: list[int]) -> None:
        """Drops one hold on each page (its copy out is dispatched, or given up); a page
        that is free stays where it is in the free lists."""
        for p in pages:
            held = self._holds.get(p, 0)
            if held <= 0:
                raise RuntimeError(f"page {p} released but not held")
            self.refcount[p] -= 1
            if held == 1:
                del self._holds[p]
            else:
                self._holds[p] = held - 1

    # ---- the prefix cache's index ----------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._page_of.get(block_hash)

    def ref(self, page: int) -> None:
        """Shares a cached page with one more sequence (takes it off the free list)."""
        if page not in self._hash_of:
            raise RuntimeError(f"page {page} is not a cached page")
        if self.is_free(page):
            del self._evictable[page]
        self.refcount[page] += 1

    def register(self, page: int, block_hash: bytes) -> bool:
        """Marks an in-use page as holding the full page `block_hash`. False where another
        page already holds it (this one then stays private and is not cached)."""
        if self.is_free(page):
            raise RuntimeError(f"page {page} is not in use")
        if block_hash in self._page_of or page in self._hash_of:
            return False
        self._page_of[block_hash] = page
        self._hash_of[page] = block_hash
        return True

    def check_consistent(self) -> None:
        """Every page exactly once: in use, plain free or cached-free (held or not);
        holds among the references (tests call this)."""
        plain, evictable = set(self._plain), set(self._evictable)
        used = {p for p in range(self.num_pages) if not self.is_free(p)}
        assert len(plain) == len(self._plain), "a page is twice on the free list"
        assert not (plain & evictable) and not (used & (plain | evictable)), "page overlap"
        assert len(plain | evictable | used) == self.num_pages, "a page went missing"
        assert all(c >= 0 for c in self.refcount)
        assert all(0 < n <= self.refcount[p] for p, n in self._holds.items())
        assert evictable <= set(self._hash_of) and not (plain & set(self._hash_of))
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())


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


KV_SHARE = 0.9  # of the memory the process takes, what the KV cache may have with the
#                weights (the rest: XLA's work buffers)
JAX_POOL_SHARE = 0.75  # jax's allocator's share of the card where no variable sets it
# the variables that set it (the older name still read; jax refuses both at once)
MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def pool_share() -> float:
    """The card's share jax's allocator was given (XLA_CLIENT_MEM_FRACTION or its older
    name, which the CLI sets from --gpu-memory-utilization; jax's default otherwise)."""
    for env in MEM_FRACTION_ENV:
        value = os.environ.get(env)
        if value:
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{env}={value!r} is not a number") from None
    return JAX_POOL_SHARE


MEMORY_KEYS = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")


def device_memory() -> dict | None:
    """The first device's allocator: peak and current bytes in use and its pool's size;
    None where the backend keeps no such count (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:
        return None
    return {k: stats[k] for k in MEMORY_KEYS if k in stats} or None


def free_device_bytes(memory_utilization: float = 0.9) -> int | None:
    """Bytes the KV cache may take on the first device, or None where unknown (CPU):
    KV_SHARE of the memory_utilization share of the card (EngineConfig's; at most jax's
    pool, which the CLI sizes to it), less what is in use (the weights)."""
    stats = device_memory()
    if not stats or "bytes_limit" not in stats:
        return None
    pool = stats["bytes_limit"]
    usable = pool * min(1.0, memory_utilization / pool_share())
    return int(usable * KV_SHARE) - int(stats.get("bytes_in_use", 0))


def pages_left_at_peak(memory: dict, page_bytes: int, memory_utilization: float) -> int:
    """KV pages that would still have fit in the engine's share of the card (as in
    free_device_bytes) at the allocator's peak: how far the fixed KV_SHARE reserve
    overshot what XLA's work buffers took (a hint for --num-pages, not applied)."""
    share = memory["bytes_limit"] * min(1.0, memory_utilization / pool_share())
    return max(0, int((share - memory["peak_bytes_in_use"]) // page_bytes))


def headroom_line(num_pages: int, pages_left: int) -> str:
    """What serve and bench print after the warm-up when its peak left pages unused."""
    return (f"KV cache {num_pages} pages; the warm-up's memory peak left room for "
            f"{pages_left} more within --gpu-memory-utilization (--num-pages sets the count)")


def max_addressable_pages(cfg: ModelConfig, page_size: int) -> int:
    """Pages one layer's pool may have: the Triton kernels use int32 element offsets."""
    from pallas_kernels.decode_attention import MAX_POOL_ELEMENTS
    return MAX_POOL_ELEMENTS // (cfg.num_kv_heads * page_size * cfg.head_dim)


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
        num_pages = min(int(memory_bytes // per_page), max_addressable_pages(cfg, page_size))
    elif num_pages > max_addressable_pages(cfg, page_size):
        raise ConfigError(f"num_pages {num_pages} is more than the attention kernels can "
                          f"address in one layer's pool "
                          f"({max_addressable_pages(cfg, page_size)} pages of {page_size})")
    if num_pages * page_size < max_model_len:
        raise ConfigError(f"KV cache of {num_pages} pages x {page_size} tokens cannot hold "
                          f"one request of max_model_len {max_model_len}")
    ctx = expected_context or max(1, max_model_len // 2)
    max_seqs = max(1, min(b_dense, num_pages * page_size // ctx))
    return CacheSizing(num_pages, page_size, max_seqs, max_model_len)
