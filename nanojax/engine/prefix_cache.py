"""Automatic prefix caching on the GPU pages (as vLLM does it).

A full page of a sequence is named by a hash chain: hash(parent page's hash, the page's
token ids), rooted at the model fingerprint, so equal names mean equal KV. A request whose
leading pages are cached shares them read-only (the allocator counts references) and
computes only the rest. It never writes into a shared page: only full pages are cached,
its last partial page is always its own, and when every page of its context is cached the
last page is still recomputed so the step has logits to sample.

Pages missing on the GPU may be in an offload tier (host memory, disk): `match` continues
the chain there and the scheduler loads those pages into fresh ones before the step. The
tier gets each page when it becomes full (`register`), not when its request finishes: a
full page never changes, and copying pages out as they fill spreads the copies over the
run instead of a burst when many requests finish together (bench/results/log/kv_reuse.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Protocol

import jax
import numpy as np

from nanojax.config import ModelConfig
from nanojax.engine.kv_cache import PageAllocator
from nanojax.engine.sequence import Sequence

HASH_BYTES = 16


def block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(),
                           digest_size=HASH_BYTES).digest()


def model_fingerprint(model_config: ModelConfig | dict, params, kv, page_size: int, page_axis: int,
                      sample_elems: int = 4096) -> bytes:
    """Names the model and the cache layout: the config, every weight's shape and dtype
    with a strided sample of its values, and each cache array's dtype and per-page shape.
    A sampled digest, not a full one: reading all of an 8B model's 16 GB at every start
    would take seconds; two checkpoints that agree on every sampled value are treated as
    one model."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    cfg = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) \
        else dict(model_config)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(f"page_size={page_size}".encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape, dtype = leaf.shape, leaf.dtype
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = leaf.addressable_shards[0].data  # several processes: this one's first shard
        flat = leaf.reshape(-1)
        stride = max(1, flat.shape[0] // sample_elems)
        sample = np.asarray(jax.device_get(flat[::stride][:sample_elems]))
        h.update(f"{jax.tree_util.keystr(path)}:{shape}:{dtype}".encode())
        h.update(sample.tobytes())
    for leaf in jax.tree_util.tree_leaves(kv):  # per page: the pool's size does not matter
        shape = leaf.shape[:page_axis] + leaf.shape[page_axis + 1:]
        h.update(f"kv:{shape}:{leaf.dtype}".encode())
    return h.digest()


class OffloadTier(Protocol):
    """Where pages evicted from (or never on) the GPU may still be found (kv_offload.py)."""

    def contains(self, block_hash: bytes) -> bool:
        """Cheap: whether a tier lists the page (admission sizing)."""

    def fetch(self, hashes: list[bytes]) -> list:
        """The leading pages' contents, stopping at the first that cannot be produced
        intact (a corrupt disk entry): those are recomputed."""

    def stage(self, pages: list[int], entries: list):
        """Starts putting fetched entries on the device for these fresh pages, off the
        engine thread: a concurrent.futures.Future whose result the engine `load`s."""

    def save(self, pages: list[int], hashes: list[bytes]) -> None:
        """Queues copies of these GPU pages, full and written (or being written) by a
        launched step; best effort (a page may be dropped). The tier holds each page in
        the allocator (PageAllocator.hold) until its copy out is dispatched, so nobody
        gets it to overwrite before then."""


@dataclasses.dataclass
class PrefixMatch:
    gpu_pages: list[int]          # cached GPU pages to share, in order
    tier_hashes: list[bytes]      # the following pages, held by an offload tier

    @property
    def num_pages(self) -> int:
        return len(self.gpu_pages) + len(self.tier_hashes)


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0      # context tokens looked up at admission (vLLM's prefix_cache_queries)
    hits: int = 0         # of those, tokens found on the GPU (prefix_cache_hits)
    tier_hits: int = 0    # tokens found in an offload tier (loaded instead of recomputed)


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, root: bytes,
                 tier: OffloadTier | None = None):
        self.allocator = allocator
        self.page_size = page_size
        self.root = root
        self.tier = tier
        self.stats = PrefixCacheStats()

    def hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """The hash chain of seq's first num_pages full pages (computed once, kept on seq)."""
        hs, ps = seq.block_hashes, self.page_size
        while len(hs) < num_pages:
            i = len(hs)
            toks = [seq.token_at(j) for j in range(i * ps, (i + 1) * ps)]
            hs.append(block_hash(hs[-1] if hs else self.root, toks))
        return hs[:num_pages]

    def match(self, seq: Sequence) -> PrefixMatch:
        """The longest cached run of seq's leading pages, leaving its last token to compute."""
        usable = (seq.num_known - 1) // self.page_size
        gpu: list[int] = []
        tier: list[bytes] = []
        for h in self.hashes(seq, usable):
            page = self.allocator.lookup(h) if not tier else None
            if page is not None:
                gpu.append(page)
            elif self.tier is not None and self.tier.contains(h):
                tier.append(h)
            else:
                break
        return PrefixMatch(gpu, tier)

    def count(self, seq: Sequence, match: PrefixMatch) -> None:
        self.stats.queries += seq.num_known
        self.stats.hits += len(match.gpu_pages) * self.page_size
        self.stats.tier_hits += len(match.tier_hashes) * self.page_size

    def register(self, seq: Sequence) -> None:
        """Caches seq's pages that became full of known tokens whose KV is written or being
        written by a launched step (later steps are ordered after it on the device)."""
        full = min(seq.num_computed, seq.num_known) // self.page_size
        if full <= seq.num_cached_pages:
            return
        hs = self.hashes(seq, full)
        for i in range(seq.num_cached_pages, full):
            self.allocator.register(seq.pages[i], hs[i])
        if self.tier is not None:
            self.tier.save(seq.pages[seq.num_cached_pages:full], hs[seq.num_cached_pages:full])
        seq.num_cached_pages = full
