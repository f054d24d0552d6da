"""Whole KV blocks of one engine's cache <-> store objects (one object per block, keyed by block hash).

Object bytes are the block's bytes in the cache layout ``[num_layers, 2, block_size, num_kv_heads,
head_dim]`` (``KVLayout.block_nbytes``); UCX reads and writes them straight from and into the cache's
preallocated memory. A request's partial last block (``tail_rows`` tokens, store transfer mode) is one object
of its used token rows only, packed (:mod:`splitserve.transfer.partial_block`): ``tail_rows`` tokens' bytes.
The cache may be in host or CUDA memory. A host cache is read and written in place; a CUDA cache goes through one
host staging buffer per load or save (pinned when CUDA is available): blocks are copied out of the device before a
save and into the device blocks once a load was verified -- every object is checksummed on the host anyway, so a
direct device read would need that copy too (``PD_KV_TRANSFER_STAGING=always`` stages a host cache the same way).
Every method is failure-tolerant in the way prefix caching needs: a lookup or read that fails
costs recomputation, never a wrong token (each block read is checked against its read lease and checksum before it is used).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import numpy as np
import torch

from splitserve.errors import ChecksumMismatch, LeaseExpired, ObjectNotReady, PdError
from splitserve.kvstore.block_hash import BlockHasher
from splitserve.kvstore.client import KVStoreClient, ObjectLocation, PutReport, PutTicket
from splitserve.telemetry.store import observe_store_op, record_lookup
from splitserve.transfer.kv_memory import KVMemory, host_buffer
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.partial_block import PartialBlock
from splitserve.transfer.paths import check_staging, staging_from_env

logger = logging.getLogger("splitserve.kvstore")


def tail_key(transfer_id: str) -> str:
    """Key of a request's partial last block in store transfer mode (one per transfer)."""
    return f"tail/{transfer_id}"


class KVBlockStore:
    """Loads and saves blocks of ``kv_cache`` (the engine's pool) through ``client``.

    ``counters`` (plain ints, event-loop thread): lookups, lookup_errors, hit_blocks, loaded_blocks,
    lease_expired, checksum_mismatch, read_failed, saved_blocks, save_existed, save_failed.

    ``staging`` (None: ``PD_KV_TRANSFER_STAGING``): a CUDA cache is always staged (whatever the setting: objects are
    checksummed on the host); "always" stages a host cache too. :attr:`path` is "host" or "staged". Raises ValueError
    on an unknown ``staging``.
    """

    def __init__(self, client: KVStoreClient, kv_cache: torch.Tensor, layout: KVLayout, salt: str = "",
                 staging: str | None = None) -> None:
        self.client = client
        self.layout = layout
        self.block_size = layout.block_size
        self.block_nbytes = layout.block_nbytes
        self.hasher = BlockHasher(layout, salt)
        self._kv = kv_cache  # keeps the memory behind the views alive
        self._partial = PartialBlock(layout)
        staging = staging_from_env() if staging is None else check_staging(staging)
        path = "staged" if kv_cache.device.type != "cpu" or staging == "always" else "host"
        self._mem = KVMemory(kv_cache, self._partial, path)
        self.path = path
        self.counters: Counter[str] = Counter()

    def keys(self, token_ids: list[int]) -> list[str]:
        """Keys of the full blocks of ``token_ids``."""
        return self.hasher.keys(token_ids)

    def block(self, block_id: int) -> np.ndarray:
        """The bytes of one block of the cache: a view (host path) or a host copy (staged path)."""
        return self._mem.host_blocks(block_id, 1) if self._mem.in_place else self._mem.gather([block_id])

    def _buffers(self, block_ids: list[int], save: bool) -> list[np.ndarray]:
        """One host buffer per block: views of the cache (host path), else slices of one staging buffer (holding
        the blocks' bytes when ``save``) -- adjacent slices go as one UCX message either way."""
        if self._mem.in_place:
            return [self._mem.host_blocks(b, 1) for b in block_ids]
        bn = self.block_nbytes
        stage = self._mem.gather(block_ids) if save else host_buffer(len(block_ids) * bn)
        return [stage[i * bn : (i + 1) * bn] for i in range(len(block_ids))]

    # ---------------------------------------------------------------- reads
    async def lookup_prefix(self, keys: list[str]) -> list[ObjectLocation]:
        """Locations (with read leases) of the leading run of complete objects among ``keys``."""
        if not keys:
            return []
        self.counters["lookups"] += 1
        try:
            results = await self.client.lookup(keys, prefix=True)
        except PdError as exc:
            self.counters["lookup_errors"] += 1
            logger.warning("KV store lookup failed, computing without it: %s", exc)
            return []
        hits = []
        for r in results:
            if not isinstance(r, ObjectLocation):
                break
            hits.append(r)
        self.counters["hit_blocks"] += len(hits)
        record_lookup(len(hits), len(keys) - len(hits))
        return hits

    async def wait_prefix(self, keys: list[str], timeout_s: float) -> list[ObjectLocation]:
        """Like :meth:`lookup_prefix`, but waits (polling, up to ``timeout_s``) for objects that are being
        written (NOT_READY) to complete -- for a decode worker reading what its prefill worker is still
        writing. The run ends at the first key that is neither complete nor being written."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pause = 0.001
        while True:
            self.counters["lookups"] += 1
            try:
                results = await self.client.lookup(keys, prefix=False)
            except PdError as exc:
                self.counters["lookup_errors"] += 1
                logger.warning("KV store lookup failed: %s", exc)
                return []
            hits, waiting = [], False
            for r in results:
                if isinstance(r, ObjectLocation):
                    hits.append(r)
                    continue
                waiting = isinstance(r, ObjectNotReady)
                break
            if not waiting or loop.time() + pause > deadline:
                self.counters["hit_blocks"] += len(hits)
                return hits
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.02)

    async def load(self, locations: list[ObjectLocation], block_ids: list[int], timeout_s: float | None = None,
                   tail_rows: int = 0) -> int:
        """Read ``locations[i]`` into block ``block_ids[i]`` within ``timeout_s`` (None: the client's I/O
        timeout per node request); returns how many *leading* blocks were loaded and verified (blocks
        after the first failure must be recomputed). ``tail_rows`` > 0: the last location is a partial block's
        packed rows ``[0, tail_rows)`` (see :meth:`finish_save`), unpacked into its block once verified."""
        if not locations:
            return 0
        dsts = self._buffers(block_ids[: len(locations)], save=False)
        staging = None
        if tail_rows:
            self._partial.check_rows(tail_rows)
            staging = dsts[-1] = np.empty(self._partial.nbytes(tail_rows), dtype=np.uint8)
        with observe_store_op("get", len(locations)) as obs:
            errors = await self.client.read(locations, dsts, timeout_s)
            n = 0
            for err in errors:
                if err is not None:
                    break
                n += 1
            whole = n - 1 if staging is not None and n == len(locations) else n  # verified whole blocks
            if not self._mem.in_place:
                for b, dst in zip(block_ids[:whole], dsts[:whole]):
                    self._mem.land(b * self.block_nbytes, dst)
            if staging is not None and n == len(locations):
                self._mem.unpack(block_ids[n - 1], tail_rows, staging)
            obs.nbytes = sum(d.nbytes for d in dsts[:n])
        for loc, err in zip(locations[n:], errors[n:]):
            if err is None:
                continue
            kind = "lease_expired" if isinstance(err, LeaseExpired) else "checksum_mismatch" if isinstance(err, ChecksumMismatch) else "read_failed"
            self.counters[kind] += 1
            logger.warning("KV store read of %s not used (%s): recomputing", loc.key, err)
            break
        self.counters["loaded_blocks"] += n
        return n

    # ---------------------------------------------------------------- writes
    async def begin_save(self, keys: list[str], tail_rows: int = 0) -> list[PutTicket | PdError]:
        """PutStart for ``keys`` (per key a ticket or the typed error); raises if the master is unreachable.
        ``tail_rows`` > 0: the last key is a partial block's, an object of ``tail_rows`` tokens' bytes."""
        if not tail_rows:
            return await self.client.put_start(keys, self.block_nbytes)
        self._partial.check_rows(tail_rows)
        full = await self.client.put_start(keys[:-1], self.block_nbytes) if len(keys) > 1 else []
        return full + await self.client.put_start(keys[-1:], self._partial.nbytes(tail_rows))

    async def finish_save(self, keys: list[str], tickets: list[PutTicket | PdError], block_ids: list[int],
                          tail_rows: int = 0) -> PutReport:
        """Write the blocks of the open tickets and publish them (PutEnd), revoking what failed. ``tail_rows``
        > 0 (as given to :meth:`begin_save`): the last block's rows ``[0, tail_rows)`` are written, packed."""
        self._mem.ready()  # a CUDA cache: the engine's KV writes are done before bytes are copied out
        if tail_rows:
            srcs = self._buffers(block_ids[:-1], save=True) + [self._mem.pack(block_ids[-1], tail_rows)]
        else:
            srcs = self._buffers(block_ids, save=True)
        with observe_store_op("put", len(keys)) as obs:
            report = await self.client.finish_put(keys, tickets, srcs)
            written = set(report.written)
            obs.nbytes = sum(src.nbytes for key, src in zip(keys, srcs) if key in written)
        self._count(report)
        return report

    async def save(self, keys: list[str], block_ids: list[int]) -> PutReport:
        """Two-phase put of blocks (keys already complete or being written are skipped)."""
        try:
            tickets = await self.begin_save(keys)
        except PdError as exc:
            self.counters["save_failed"] += len(keys)
            logger.warning("KV store put of %d blocks failed: %s", len(keys), exc)
            return PutReport(failed={k: exc for k in keys})
        return await self.finish_save(keys, tickets, block_ids)

    def _count(self, report: PutReport) -> None:
        self.counters["saved_blocks"] += len(report.written)
        self.counters["save_existed"] += len(report.existed)
        self.counters["save_failed"] += len(report.failed)
        for key, err in list(report.failed.items())[:1]:
            logger.warning("KV store put of %d blocks failed, e.g. %s: %s", len(report.failed), key, err)
