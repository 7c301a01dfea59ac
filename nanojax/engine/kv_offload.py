"""Offload tiers for the KV cache: host memory and a bounded directory on disk.

NanoFlow keeps the KV of a finished conversation round in host memory and on SSD and
loads it back when the conversation returns, instead of recomputing the prefill. Here each
page is copied out by prefix hash once it is full (the prefix cache registers it; a full
page never changes), so the copies spread over a request's life, and a finished request
offers its pages again (those dropped earlier):

- device -> host: one jitted gather packs the pages into one [pages, page bytes] uint8
  array (every paged leaf of the cache, bit-cast, side by side), dispatched between steps;
  a background thread copies it to the host in one copy (through pinned memory on a GPU,
  see `split`) and keeps one row per page, a view of that block, and another writes the
  disk tier (pages beyond a backlog limit are skipped, not waited for). The engine thread
  only dispatches.
  Gathers are batched: a gather costs the engine thread the same dispatch (a kernel per
  cache leaf) whether it copies 5 pages or 128, and an engine that saved a few pages per
  iteration spent a sizeable share of each step on one gather each (measured:
  bench/results/log/kv_reuse.md). So
  `save` queues pages and takes a hold on each (PageAllocator.hold: the page is not
  handed out again, hence not overwritten, until its gather is dispatched; the gather is
  ordered on the device after every step launched before it), and `flush` dispatches
  whole chunks of chunk_pages only; the rest goes when its oldest page has waited
  MAX_SAVE_WAIT flushes, when the engine has nothing to run, on `drain`, or when the
  allocator is about to hand out a held page (its `reclaim`; a held page that no
  sequence uses counts as free, so admission and preemption do not change).
  Gathers not yet copied out hold device memory: past MAX_PENDING_BYTES a save is dropped
  (the pages cost a recompute later), never a stall now.
- host -> device: a request whose prefix continues in a tier gets fresh pages; a loader
  thread stacks the rows and puts them on the device (through pinned memory on a GPU),
  while the request waits out of the batch, so the engine thread never copies host
  memory; then one scatter of the staged rows is dispatched before its first step. When
  a request arrives, the pages of its prefix that only the disk holds are read into host
  memory in the background
  (`prefetch`); a page still on disk at admission is read there, synchronously.

Both tiers are LRU with byte limits. The disk tier lives in DIR/<model fingerprint>/ so a
restarted server with the same model and cache layout reuses it and another model never
sees it; each file carries its hash, fingerprint and a checksum of its payload, and an
entry that fails any check is deleted and reported missing (the pages are recomputed).
The copies work on the cache's pytree (any leaves with a page axis, e.g. k, v and scales),
not on a fixed k/v pair: a page is its bytes in every paged leaf, one flat row, so the host
side handles one array per page whatever the layout (a per-layer cache has 64 leaves).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.engine.kv_cache import PageAllocator
from nanojax.errors import ConfigError

log = logging.getLogger(__name__)

Entry = np.ndarray  # one page: its bytes in every paged cache leaf, a flat uint8 row


MAX_COPY_PAGES = 256  # pages per gather / scatter at most
COPY_CHUNK_BYTES = 256 << 20  # and at most this much per copy: bounds its device memory
MAX_PENDING_BYTES = 2 << 30  # gathered on the device, not yet on the host: beyond, drop
# flushes (one per engine iteration) a queued page waits for its chunk to fill before it
# is gathered anyway: bounds how far saves lag at low load (~0.3 s at 10 ms steps) and
# how long pages stay held, while a few pages an iteration still make one gather per
# ~30 iterations, not one each (LLaMA-3-8B's chunk of 128 pages fills in ~26 at 5 a step)
MAX_SAVE_WAIT = 32
DISK_BACKLOG_BYTES = 2 << 30  # pages waiting for the disk beyond this are not written


def _bucket(n: int) -> int:
    return max(4, 1 << (n - 1).bit_length())


def _chunks(xs: list, n: int):
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def entry_bytes(entry: Entry) -> int:
    return entry.nbytes


def _has_pinned_host(x: jax.Array) -> bool:
    """Whether x's devices have a pinned_host memory (jax's GPU and CPU clients do)."""
    try:
        return all(any(m.kind == "pinned_host" for m in d.addressable_memories())
                   for d in x.devices())
    except (AttributeError, RuntimeError):
        return False


class PageCopier:
    """Jitted gather / scatter of whole pages over every leaf of the cache that has the
    page axis (leaves without it, e.g. per-layer scales, are not per page). A gathered
    page is one flat uint8 row: each paged leaf's page, bit-cast to bytes, side by side."""

    def __init__(self, runner, num_pages: int, page_axis: int):
        self.runner, self.num_pages, self.axis = runner, num_pages, page_axis
        leaves = jax.tree_util.tree_leaves(runner.kv)
        self.paged = [leaf.ndim > page_axis and leaf.shape[page_axis] == num_pages
                      for leaf in leaves]
        if not any(self.paged):
            raise ConfigError(f"no cache array has {num_pages} pages on axis {page_axis}")
        ax = page_axis
        # (page shape, dtype) of each paged leaf, in tree order: the row's layout
        self.layout = [(leaf.shape[:ax] + leaf.shape[ax + 1:], leaf.dtype)
                       for leaf, p in zip(leaves, self.paged) if p]
        self.page_bytes = sum(int(np.prod(shape)) * np.dtype(dt).itemsize
                              for shape, dt in self.layout)
        self.chunk_pages = min(MAX_COPY_PAGES, 1 << max(
            2, (COPY_CHUNK_BYTES // self.page_bytes).bit_length() - 1))
        self.pinned = _has_pinned_host(leaves[0])  # the host copies' way, see `split`
        devices = leaves[0].sharding.device_set
        # where loads are staged; a cache over several devices: rows stay on the host
        self.device = next(iter(devices)) if len(devices) == 1 else None

        def gather(kv, idx):
            rows = []
            for leaf, p in zip(jax.tree_util.tree_leaves(kv), self.paged):
                if p:
                    x = jnp.moveaxis(jnp.take(leaf, idx, axis=ax), ax, 0)
                    x = jax.lax.bitcast_convert_type(x.reshape(len(idx), -1), jnp.uint8)
                    rows.append(x.reshape(len(idx), -1))
            return jnp.concatenate(rows, axis=1)

        def scatter(kv, idx, rows):
            leaves, tree = jax.tree_util.tree_flatten(kv)
            where = (slice(None),) * ax + (idx,)
            out, off, n, layout = [], 0, len(idx), iter(self.layout)
            for leaf, p in zip(leaves, self.paged):
                if not p:
                    out.append(leaf)
                    continue
                shape, dt = next(layout)
                size = np.dtype(dt).itemsize
                b = rows[:, off:off + int(np.prod(shape)) * size]
                off += b.shape[1]
                b = b.reshape(n, -1, size) if size > 1 else b
                x = jax.lax.bitcast_convert_type(b, dt).reshape((n,) + shape)
                out.append(leaf.at[where].set(jnp.moveaxis(x, 0, ax), mode="drop"))
            return jax.tree_util.tree_unflatten(tree, out)

        self._gather = jax.jit(gather)
        self._scatter = jax.jit(scatter, donate_argnums=(0,))

    def start_gather(self, pages: list[int]) -> jax.Array:
        """Dispatches the gather of `pages` (ordered after every step launched so far) and
        returns at once; `split` copies it to the host."""
        idx = np.zeros(_bucket(len(pages)), np.int32)
        idx[:len(pages)] = pages
        return self.runner.with_kv(lambda kv: self._gather(kv, idx))

    def gathered_bytes(self, pages: int) -> int:
        return _bucket(pages) * self.page_bytes

    def warmup(self) -> int:
        """Compiles the gather and scatter for every page bucket (a serving start), so a
        copy never waits on a compile mid-run; changes nothing. Returns the count."""
        sizes = [4 << i for i in range((self.chunk_pages // 4).bit_length())]
        for b in sizes:
            zeros = np.zeros(b, np.int32)
            out = jax.block_until_ready(self.runner.with_kv(lambda kv: self._gather(kv, zeros)))
            rows = self._to_device(np.zeros(out.shape, out.dtype))  # as `stage` places them
            idx = np.full(b, self.num_pages, np.int32)  # all out of range: nothing written
            self.runner.update_kv(lambda kv: self._scatter(kv, idx, rows))
        jax.block_until_ready(self.runner.kv)
        return 2 * len(sizes)

    def split(self, gathered: jax.Array, n: int) -> list[Entry]:
        """Copies a gather to the host; one row per page, each a view of one block that
        this copy owns (never the cache's memory: on the CPU `np.asarray` may alias it).
        On a GPU the copy goes through pinned host memory: jaxlib starts a copy into
        numpy's pageable memory with the GIL held, and XLA's stream executor may run that
        copy on the calling thread, blocking until the device gets there, which would
        stall the engine thread for the GIL. A device_put to pinned_host releases the GIL
        and returns at once, and numpy reads the pinned buffer in place. The chunk is ONE
        numpy copy, which runs without the GIL: one GIL round trip per chunk, not per page
        (a copy per page must win the GIL back from the busy engine thread each time; a
        memcpy per page with the GIL held stalls the engine thread for all of it:
        bench/results/kv_reuse/host_split_cpu_chunk.json). HostTier charges the block once."""
        if self.pinned:
            gathered = jax.device_put(gathered,
                                      gathered.sharding.with_memory_kind("pinned_host"))
        block = np.array(np.asarray(gathered)[:n])
        return list(block)

    def _to_device(self, rows: np.ndarray):
        """Host rows onto the cache's device (through pinned memory where there is some:
        the transfer then runs without the GIL); a multi-device cache takes them as is."""
        if self.device is None:
            return rows
        if self.pinned:
            rows = jax.device_put(rows, jax.sharding.SingleDeviceSharding(
                self.device, memory_kind="pinned_host"))
        return jax.device_put(rows, jax.sharding.SingleDeviceSharding(self.device))

    def stage(self, pages: list[int], entries: list[Entry]) -> list[tuple]:
        """Stacks entries into page-bucket chunks on the device: (page index, rows) per
        chunk, for `scatter` (the loader thread's work: the copies, not the engine's)."""
        staged, n = [], self.chunk_pages
        for i in range(0, len(pages), n):
            ps, es = pages[i:i + n], entries[i:i + n]
            b = _bucket(len(ps))
            idx = np.full(b, self.num_pages, np.int32)  # padding rows fall out of range
            idx[:len(ps)] = ps
            rows = np.empty((b, self.page_bytes), np.uint8)  # one pass over the bytes
            for j, e in enumerate(es):  # each a page of this cache (DiskTier checks)
                rows[j] = e
            rows[len(es):] = 0  # padding rows land nowhere, but stay defined
            staged.append((idx, self._to_device(rows)))
        return staged

    def scatter(self, staged: list[tuple]) -> None:
        """Dispatches the copy of staged chunks into their pages, before the next step."""
        for idx, rows in staged:
            self.runner.update_kv(lambda kv: self._scatter(kv, idx, rows))


def _backing(entry: Entry) -> np.ndarray:
    """The array whose memory an entry holds: the block it is a view of (a split's pages),
    else the entry itself."""
    root = entry
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root


class HostTier:
    """Pages in host memory by prefix hash, least recently used dropped beyond max_bytes.

    A split's pages are views of one block: the tier charges that block once, its whole
    nbytes, while any of its pages is held, and releases it with the last one (evicting
    until the charges fit). A chunk's pages are saved together and usually age together,
    so evicting by page frees whole blocks soon enough, and the memory held is never more
    than charged. An entry that owns its memory (a disk read) is charged for itself."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0  # charged: the host memory the held entries keep alive
        # hash -> (entry, id of its shared backing, or None: it owns its memory)
        self._pages: collections.OrderedDict[bytes, tuple[Entry, int | None]] = (
            collections.OrderedDict())
        self._shared: dict[int, list] = {}  # id -> [backing, pages held]; keeps id valid
        self._lock = threading.Lock()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    def contains(self, h: bytes) -> bool:
        return h in self._pages

    def get(self, h: bytes) -> Entry | None:
        with self._lock:
            got = self._pages.get(h)
            if got is None:
                return None
            self._pages.move_to_end(h)
            return got[0]

    def put(self, h: bytes, entry: Entry) -> None:
        self.put_many([h], [entry])

    def put_many(self, hashes: list[bytes], entries: list[Entry]) -> None:
        """put() of each pair, under one lock (a split's chunk: one block backs them all)."""
        with self._lock:
            backing = None
            for h, entry in zip(hashes, entries):
                if backing is None or entry.base is not backing:  # else: the same block
                    backing = _backing(entry)
                self._put(h, entry, backing)

    def _put(self, h: bytes, entry: Entry, backing: np.ndarray) -> None:
        key = None if backing is entry else id(backing)
        if backing.nbytes > self.max_bytes:
            return
        if h in self._pages:
            self._pages.move_to_end(h)
            return
        if key is not None and key in self._shared:  # already charged: no eviction
            self._shared[key][1] += 1
        else:
            while self.bytes + backing.nbytes > self.max_bytes:
                self._evict_oldest()
            self.bytes += backing.nbytes
            if key is not None:
                self._shared[key] = [backing, 1]
        self._pages[h] = (entry, key)

    def _evict_oldest(self) -> None:
        _, (entry, key) = self._pages.popitem(last=False)
        self.num_evictions += 1
        if key is None:
            self.bytes -= entry.nbytes
            return
        held = self._shared[key]
        held[1] -= 1
        if held[1] == 0:
            del self._shared[key]
            self.bytes -= held[0].nbytes


MAGIC = b"NJKV2\n"  # 2: a page is one byte row (1 held an array per leaf)


class DiskTier:
    """Pages as files in DIR/<fingerprint>/, least recently used deleted beyond max_bytes.

    A file: MAGIC, an 8-byte header length, a JSON header (fingerprint, hash, payload
    length and blake2b digest), then the page's bytes (the fingerprint fixes their layout). Any
    mismatch on reading (truncation, flipped bits, another model's file) deletes the file
    and reads as a miss."""

    def __init__(self, root: str | os.PathLike, fingerprint: bytes, max_bytes: int,
                 page_bytes: int | None = None):
        if max_bytes <= 0:
            raise ConfigError(f"the disk tier needs a positive byte limit, got {max_bytes}")
        self.fingerprint = fingerprint.hex()
        self.dir = Path(root) / self.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.page_bytes = max_bytes, page_bytes  # page_bytes: None, any
        self.bytes = 0
        self._files: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_corrupt = self.num_evictions = 0
        for f in self.dir.glob("*.tmp"):  # a write cut short by a crash
            f.unlink(missing_ok=True)
        found = []
        for f in self.dir.glob("*.kv"):
            try:
                st = f.stat()
                found.append((st.st_mtime, bytes.fromhex(f.stem), st.st_size))
            except (OSError, ValueError):
                continue
        for _, h, size in sorted(found):  # oldest first: the LRU order across restarts
            self._files[h] = size
            self.bytes += size
        self._evict(0)

    def __len__(self) -> int:
        return len(self._files)

    def path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}.kv"

    def contains(self, h: bytes) -> bool:
        return h in self._files

    def _evict(self, incoming: int) -> None:
        while self._files and self.bytes + incoming > self.max_bytes:
            h, size = self._files.popitem(last=False)
            self.bytes -= size
            self.num_evictions += 1
            self.path(h).unlink(missing_ok=True)

    def put(self, h: bytes, entry: Entry) -> None:
        # numpy's stubs give ndarray __buffer__ (collections.abc.Buffer) on Python >= 3.12 only
        payload = memoryview(entry).cast("B")  # type: ignore[arg-type]  # the page's bytes, not copied
        header = json.dumps({
            "fingerprint": self.fingerprint, "hash": h.hex(), "payload_bytes": len(payload),
            "digest": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
        size = len(MAGIC) + 8 + len(header) + len(payload)
        if size > self.max_bytes:
            return
        with self._lock:
            if h in self._files:
                return
            self._evict(size)
            tmp = self.path(h).with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                f.write(payload)
            os.replace(tmp, self.path(h))  # readers see a whole file or none
            self._files[h] = size
            self.bytes += size

    def get(self, h: bytes) -> Entry | None:
        with self._lock:
            if h not in self._files:
                return None
            path = self.path(h)
            try:
                entry = self._read(path, h)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("kv offload: dropping bad disk entry %s: %s", path.name, e)
                self.num_corrupt += 1
                self.bytes -= self._files.pop(h)
                path.unlink(missing_ok=True)
                return None
            self._files.move_to_end(h)
            os.utime(path)
            return entry

    def _read(self, path: Path, h: bytes) -> Entry:
        blob = path.read_bytes()
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 8:
            raise ValueError("not a nanojax KV page file")
        (hlen,) = struct.unpack("<Q", blob[len(MAGIC):len(MAGIC) + 8])
        start = len(MAGIC) + 8
        head = json.loads(blob[start:start + hlen])
        payload = memoryview(blob)[start + hlen:]
        if head["fingerprint"] != self.fingerprint or head["hash"] != h.hex():
            raise ValueError("written for another model or page")
        if len(payload) != head["payload_bytes"]:
            raise ValueError(f"truncated: {len(payload)} of {head['payload_bytes']} bytes")
        if self.page_bytes is not None and len(payload) != self.page_bytes:
            raise ValueError(f"a page of {len(payload)} bytes, this cache's are "
                             f"{self.page_bytes}")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != head["digest"]:
            raise ValueError("checksum mismatch")
        return np.frombuffer(payload, np.uint8)


@dataclasses.dataclass
class OffloadStats:
    saved_pages: int = 0         # pages copied out to a tier
    loaded_host_pages: int = 0   # pages loaded back from host memory
    loaded_disk_pages: int = 0   # pages loaded back from disk at admission
    prefetched_disk_pages: int = 0  # pages read from disk into host memory on arrival
    save_errors: int = 0
    disk_writes_dropped: int = 0  # the disk fell behind by DISK_BACKLOG_BYTES: not written
    saves_dropped: int = 0  # pages not saved: MAX_PENDING_BYTES of gathers not yet copied
    gathers: int = 0  # gathers dispatched (each copies up to chunk_pages pages out)


class KVOffloader:
    """The offload tiers as the prefix cache sees them (`contains`, `fetch`, `save` pages
    as they fill) and as the engine drives them (`flush` once per iteration, forced when
    it has nothing to run; `load` admitted pages before a step; `save` a finished
    request's pages again).

    allocator: the cache's PageAllocator; saved pages are held there until their gather
    is dispatched, and its `reclaim` is a forced flush. None (copy probes, unit tests):
    nothing is held; the caller keeps the pages unchanged until they are flushed."""

    def __init__(self, runner, num_pages: int, page_axis: int, fingerprint: bytes,
                 host_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0,
                 allocator: PageAllocator | None = None):
        if host_bytes < 0 or disk_bytes < 0:
            raise ConfigError("offload byte limits must be >= 0")
        if host_bytes == 0 and disk_dir is None:
            raise ConfigError("KV offload needs host bytes or a disk directory")
        self.copier = PageCopier(runner, num_pages, page_axis)
        self.host = HostTier(host_bytes) if host_bytes else None
        self.disk = (DiskTier(disk_dir, fingerprint, disk_bytes, self.copier.page_bytes)
                     if disk_dir else None)
        self.stats = OffloadStats()
        self.allocator = allocator
        if allocator is not None:
            allocator.reclaim = self._reclaim
        self._flushes = 0  # flush calls so far: the clock of MAX_SAVE_WAIT
        self._to_save: list[tuple[int, bytes, int]] = []  # (page, hash, flush queued at)
        self._queued: set[bytes] = set()   # hashes between save() and their tier
        self._work: queue.Queue = queue.Queue()
        self._disk_q: queue.Queue = queue.Queue()
        self._disk_backlog = self._pending = 0  # bytes for the disk / gathered on device
        self._backlog_lock = threading.Lock()
        self._loader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="nanojax-kv-load")
        self._threads = [threading.Thread(target=self._worker, name="nanojax-kv-offload",
                                          daemon=True),
                         threading.Thread(target=self._disk_writer, name="nanojax-kv-disk",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    # ---- the tier protocol (engine thread) -------------------------------------------------
    def contains(self, h: bytes) -> bool:
        return ((self.host is not None and self.host.contains(h))
                or (self.disk is not None and self.disk.contains(h)))

    def fetch(self, hashes: list[bytes]) -> list[Entry]:
        """The entries of the leading hashes, stopping at the first one no tier can
        produce intact."""
        out = []
        for h in hashes:
            e = self.host.get(h) if self.host is not None else None
            if e is not None:
                self.stats.loaded_host_pages += 1
            elif self.disk is not None and (e := self.disk.get(h)) is not None:
                self.stats.loaded_disk_pages += 1
                if self.host is not None:
                    self.host.put(h, e)
            if e is None:
                break
            out.append(e)
        return out

    # ---- engine side -----------------------------------------------------------------------
    def save(self, pages: list[int], hashes: list[bytes]) -> None:
        """Queues full pages for the tiers (those not there or on the way yet), holding
        each in the allocator until its gather is dispatched (`flush`)."""
        for p, h in zip(pages, hashes):
            if h in self._queued or (self.host is not None and self.host.contains(h)) or (
                    self.host is None and self.disk is not None and self.disk.contains(h)):
                continue
            if self.allocator is not None:
                self.allocator.hold(p)
            self._queued.add(h)
            self._to_save.append((p, h, self._flushes))

    def flush(self, force: bool = False) -> None:
        """Dispatches the copy out of the queued pages in whole chunks of chunk_pages;
        all of them when forced or when the oldest has waited MAX_SAVE_WAIT flushes. Each
        gather reads its pages after every step launched before it, then their holds go."""
        self._flushes += 1
        queued = self._to_save
        if not queued:
            return
        n, chunk = len(queued), self.copier.chunk_pages
        if not force and self._flushes - queued[0][2] < MAX_SAVE_WAIT:
            n -= n % chunk
            if not n:
                return
        self._to_save = queued[n:]
        for part in _chunks(queued[:n], chunk):
            self._dispatch([p for p, _, _ in part], [h for _, h, _ in part])

    def _reclaim(self) -> None:
        """The allocator needs the held pages: dispatch every queued gather now."""
        self.flush(force=True)

    def _dispatch(self, pages: list[int], hashes: list[bytes]) -> None:
        """One gather to the worker, or dropped; the pages' holds go either way."""
        try:
            size = self.copier.gathered_bytes(len(pages))
            with self._backlog_lock:
                drop = self._pending + size > MAX_PENDING_BYTES
                self._pending += 0 if drop else size
            if drop:  # the host copies are that far behind: these cost a recompute
                self.stats.saves_dropped += len(pages)
                self._queued.difference_update(hashes)
                return
            try:
                gathered = self.copier.start_gather(pages)
            except Exception:  # a failed copy out costs a recompute, never the engine
                with self._backlog_lock:
                    self._pending -= size
                self.stats.save_errors += 1
                self._queued.difference_update(hashes)
                log.exception("kv offload: gathering %d pages failed", len(pages))
                return
            self.stats.gathers += 1
            self._work.put((hashes, gathered, size))
        finally:
            if self.allocator is not None:
                self.allocator.release(pages)

    def prefetch(self, hashes: list[bytes]) -> None:
        """A request arrived with these page hashes: read the ones only the disk holds
        into host memory in the background, so its admission need not wait on the disk."""
        if self.host is not None and self.disk is not None and hashes:
            self._work.put(("prefetch", hashes))

    def stage(self, pages: list[int], entries: list[Entry]) -> concurrent.futures.Future:
        """Starts putting a request's tier pages on the device (loader thread); the
        scheduler holds the request until the Future is done, then `load`s its result."""
        return self._loader.submit(self.copier.stage, list(pages), list(entries))

    def load(self, loads: list[list[tuple]]) -> None:
        """Dispatches the copies of staged loads into their pages (before the step)."""
        for staged in loads:
            self.copier.scatter(staged)

    def warmup(self) -> int:
        return self.copier.warmup()

    def drain(self) -> None:
        """Dispatches every queued page and waits until every copy out sits in its tier
        (tests, shutdown: on the engine thread, or with the engine stopped)."""
        self.flush(force=True)
        self._work.join()
        self._disk_q.join()

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.drain()
        self._work.put(None)
        self._disk_q.put(None)
        for t in self._threads:
            t.join(timeout=10)

    # ---- background thread -------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                self._work.task_done()
                return
            if item[0] == "prefetch":
                self._prefetch(item[1])
                continue
            hashes, gathered, size = item
            item = None  # `gathered` alone holds the device copy: dropped after the split
            try:
                entries = self.copier.split(gathered, len(hashes))
                gathered = None  # its device memory goes back now
                if self.host is not None:  # one lock for the chunk, not one a page
                    self.host.put_many(hashes, entries)
                if self.disk is not None:
                    for h, e in zip(hashes, entries):
                        self._to_disk(h, e)
                self.stats.saved_pages += len(entries)
            except Exception:  # a failed copy out costs a recompute, never the engine
                self.stats.save_errors += 1
                log.exception("kv offload: saving %d pages failed", len(hashes))
            finally:
                with self._backlog_lock:
                    self._pending -= size
                self._queued.difference_update(hashes)
                self._work.task_done()

    def _to_disk(self, h: bytes, e: Entry) -> None:
        """Hands a page to the disk writer, unless the disk is that far behind (the page
        then costs a recompute later, never a stall now)."""
        with self._backlog_lock:
            if self._disk_backlog + entry_bytes(e) > DISK_BACKLOG_BYTES:
                self.stats.disk_writes_dropped += 1
                return
            self._disk_backlog += entry_bytes(e)
        self._disk_q.put((h, e))

    def _disk_writer(self) -> None:
        while True:
            item = self._disk_q.get()
            if item is None:
                self._disk_q.task_done()
                return
            h, e = item
            assert self.disk is not None  # _to_disk queues pages only with a disk tier
            try:
                self.disk.put(h, e)
            except OSError:
                log.exception("kv offload: writing a page to %s failed", self.disk.dir)
            finally:
                with self._backlog_lock:
                    self._disk_backlog -= entry_bytes(e)
                self._disk_q.task_done()

    def _prefetch(self, hashes: list[bytes]) -> None:
        try:
            # prefetch() queues hashes only with both tiers
            assert self.host is not None and self.disk is not None
            for h in hashes:
                if self.host.contains(h):
                    continue
                e = self.disk.get(h) if self.disk.contains(h) else None
                if e is None:
                    break
                self.host.put(h, e)
                self.stats.prefetched_disk_pages += 1
        except Exception:
            log.exception("kv offload: prefetch failed")
        finally:
            self._work.task_done()
