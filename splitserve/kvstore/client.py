"""KV store client: master calls over gRPC (control) + object bytes to/from storage nodes over UCX (data).

Reads (``lookup`` then ``read``): the master grants a read lease of ``lease_ms`` with every location. The
client starts the lease clock when it *sent* the lookup (so its deadline is never later than the
master's), reads the bytes from the first replica that answers, and then checks, in this order:

* the lease: finished after the deadline -> :class:`LeaseExpired` (the space may have been evicted and
  reused meanwhile; the caller must not use the bytes -- it recomputes);
* the checksum recorded at PutEnd (xxh3_64) -> :class:`ChecksumMismatch` otherwise.

Writes are two-phase (``put_start`` -> ``write`` to every replica -> ``put_end`` with the checksum, or
``put_revoke`` when the bytes could not be written). ``put`` does all three for a batch.

Results of batch calls are per key: a location/ticket, or the typed error of that key (never empty bytes
or a sentinel). A call that fails as a whole (master unreachable) raises ``WorkerUnavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
import numpy as np
import xxhash
from pd.v1 import kvstore_pb2 as kv, kvstore_pb2_grpc

from splitserve.errors import ChecksumMismatch, LeaseExpired, ObjectAlreadyExists, PdError, StoreIOError
from splitserve.kvstore.data_client import StoreDataClient
from splitserve.kvstore.suspects import SuspectNodes
from splitserve.rpc.server import channel
from splitserve.rpc.status import store_error, store_error_from_rpc
from splitserve.rpc.tls import TlsConfig

logger = logging.getLogger("splitserve.kvstore.client")


def checksum(buf: np.ndarray) -> int:
    """xxh3_64 (seed 0) of an object's bytes, as recorded at PutEnd and verified after reads."""
    return xxhash.xxh3_64_intdigest(memoryview(buf).cast("B"))


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    node_id: str
    endpoint: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """A COMPLETE object and its read lease; ``lease_deadline`` is on the client's clock."""

    key: str
    size: int
    checksum: int
    replicas: tuple[ReplicaInfo, ...]
    lease_deadline: float


@dataclass(frozen=True, slots=True)
class PutTicket:
    """An open write (PutStart done): write ``size`` bytes to every replica, then PutEnd."""

    key: str
    put_id: int
    size: int
    replicas: tuple[ReplicaInfo, ...]


@dataclass
class PutReport:
    written: list[str] = field(default_factory=list)  # keys published by this call
    existed: list[str] = field(default_factory=list)  # already complete or being written by someone else
    failed: dict[str, PdError] = field(default_factory=dict)


def _replicas(msgs) -> tuple[ReplicaInfo, ...]:
    return tuple(ReplicaInfo(r.node_id, r.endpoint, r.offset, r.size) for r in msgs)


class KVStoreClient:
    """Client of one store (master address). Start/close and use it on one event loop.

    Args:
        replicas: copies per object asked at PutStart (0: the master's default).
        rpc_timeout_s: deadline of each master call. io_timeout_s: deadline of each UCX read/write.
        connect_timeout_s: a storage node not accepting a connection within this long counts as down.
        suspect_s: after a read or write from a node failed, the node is skipped for this long (until the
            master, after its heartbeat timeout, stops listing it; see :mod:`splitserve.kvstore.suspects`).
        clock: monotonic seconds (injectable for lease tests).
        tls: TLS (and a client certificate for mutual TLS) of the master channel when enabled; the UCX
            data plane to storage nodes is not encrypted.
    """

    def __init__(self, master: str, *, replicas: int = 0, rpc_timeout_s: float = 5.0, io_timeout_s: float = 5.0,
                 connect_timeout_s: float = 1.0, suspect_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 tls: TlsConfig | None = None) -> None:
        self.master = master
        self.replicas = replicas
        self.rpc_timeout_s = rpc_timeout_s
        self.io_timeout_s = io_timeout_s
        self.clock = clock
        self._channel = channel(master, tls)
        self._stub = kvstore_pb2_grpc.KVStoreMasterServiceStub(self._channel)
        self.data = StoreDataClient(connect_timeout_s)
        self.suspects = SuspectNodes(suspect_s, clock)

    async def start(self) -> None:
        await self.data.start()

    async def close(self) -> None:
        await self.data.close()
        await self._channel.close()

    async def _rpc(self, method, request):
        try:
            return await method(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise store_error_from_rpc(exc, f"kvstore master {self.master}") from exc

    # ---------------------------------------------------------------- control plane
    async def lookup(self, keys: list[str], *, prefix: bool = False) -> list[ObjectLocation | PdError]:
        """Locations (with read leases) per key. ``prefix``: the master stops after the first key that is
        not COMPLETE, so the list may be shorter than ``keys`` and only its last entry can be an error."""
        if not keys:
            return []
        sent = self.clock()
        resp = await self._rpc(self._stub.BatchGetReplicaList, kv.BatchGetReplicaListRequest(keys=keys, prefix=prefix))
        out: list[ObjectLocation | PdError] = []
        for r in resp.results:
            err = store_error(r.status, r.detail)
            out.append(err if err is not None else
                       ObjectLocation(r.key, r.size, r.checksum, _replicas(r.replicas), sent + r.lease_ms / 1000))
        return out

    async def exist(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        return list((await self._rpc(self._stub.BatchExist, kv.BatchExistRequest(keys=keys))).exists)

    async def put_start(self, keys: list[str], size: int) -> list[PutTicket | PdError]:
        if not keys:
            return []
        resp = await self._rpc(self._stub.BatchPutStart, kv.BatchPutStartRequest(keys=keys, size=size, replicas=self.replicas))
        return [store_error(r.status, r.detail) or PutTicket(r.key, r.put_id, size, _replicas(r.replicas)) for r in resp.results]

    async def put_end(self, tickets: list[PutTicket], checksums: list[int]) -> list[PdError | None]:
        if not tickets:
            return []
        items = [kv.PutEndRequest(key=t.key, put_id=t.put_id, checksum=c) for t, c in zip(tickets, checksums)]
        resp = await self._rpc(self._stub.BatchPutEnd, kv.BatchPutEndRequest(items=items))
        return [store_error(r.status, r.detail) for r in resp.results]

    async def put_revoke(self, tickets: list[PutTicket]) -> None:
        """Best effort: a failure is logged (the master reclaims the space after its put timeout anyway).
        Replicas on nodes this client now suspects (a write there failed) are reported, so the master stops
        placing new objects there before its heartbeat timeout."""
        if not tickets:
            return
        items = [kv.PutRevokeRequest(key=t.key, put_id=t.put_id,
                                     failed_node_ids=sorted({r.node_id for r in t.replicas if r.endpoint in self.suspects}))
                 for t in tickets]
        try:
            await self._rpc(self._stub.BatchPutRevoke, kv.BatchPutRevokeRequest(items=items))
        except PdError as exc:
            logger.warning("revoking %d writes failed (the master reclaims them later): %s", len(items), exc)

    async def remove(self, key: str, *, ignore_lease: bool = False) -> None:
        """Raises ObjectNotFound, ObjectNotReady, ObjectHasLease (``ignore_lease``: remove even if leased)."""
        await self._rpc(self._stub.Remove, kv.RemoveRequest(key=key, ignore_lease=ignore_lease))

    # ---------------------------------------------------------------- data plane
    async def read(self, locations: list[ObjectLocation], dsts: list[np.ndarray],
                   timeout_s: float | None = None) -> list[PdError | None]:
        """Read each object into its ``dst`` (exactly ``size`` bytes); per object None or the error.

        Objects are grouped into one UCX request per storage node; an object whose node fails is retried
        on its next replica. Replicas on suspect nodes are skipped (an object with no other replica fails
        at once). Each request gets at most ``io_timeout_s``, the whole read at most ``timeout_s`` (None:
        no overall bound). Each result is verified (lease, then checksum) before it is reported OK.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        results: list[PdError | None] = [None] * len(locations)
        attempt = [0] * len(locations)
        todo = []
        for i, (loc, dst) in enumerate(zip(locations, dsts)):
            if dst.nbytes != loc.size:
                results[i] = StoreIOError(f"buffer of {dst.nbytes} bytes for object {loc.key} of {loc.size} bytes")
            elif not loc.replicas:
                results[i] = StoreIOError(f"object {loc.key} has no live replica")
            else:
                todo.append(i)
        while todo:
            by_node: dict[str, list[int]] = {}
            for i in todo:
                replica = self._next_replica(locations[i], attempt, i)
                if replica is None:
                    results[i] = results[i] or StoreIOError(
                        f"every replica of {locations[i].key} is on a storage node that failed recently")
                else:
                    by_node.setdefault(replica.endpoint, []).append(i)
            remaining = self.io_timeout_s if deadline is None else min(self.io_timeout_s, deadline - loop.time())
            if by_node and remaining <= 0:
                for idx in by_node.values():
                    for i in idx:
                        results[i] = StoreIOError(f"no time left to read {locations[i].key}")
                break
            outcomes = await asyncio.gather(
                *(self._timed(self.data.read(ep, [(locations[i].replicas[attempt[i]].offset, dsts[i]) for i in idx],
                                             remaining)) for ep, idx in by_node.items()),
                return_exceptions=True,
            )
            todo = []
            for (ep, idx), timed in zip(by_node.items(), outcomes):
                if isinstance(timed, BaseException):  # cancelled
                    raise timed
                outcome, took = timed
                if isinstance(outcome, BaseException):
                    err = outcome if isinstance(outcome, PdError) else StoreIOError(repr(outcome))
                    logger.info("store read from %s failed (%s); trying other replicas", ep, err)
                    if not (remaining < self.io_timeout_s and took >= remaining):  # not just our short budget
                        self.suspects.mark(ep)
                    for i in idx:
                        results[i] = err
                        attempt[i] += 1
                        todo.append(i)
                else:
                    for i in idx:
                        results[i] = None
        now = self.clock()
        for i, loc in enumerate(locations):
            if results[i] is None:
                if now > loc.lease_deadline:
                    results[i] = LeaseExpired(f"read of {loc.key} finished {now - loc.lease_deadline:.3f}s after its lease ended")
                elif checksum(dsts[i]) != loc.checksum:
                    results[i] = ChecksumMismatch(f"object {loc.key}: bytes read do not match the checksum recorded at PutEnd")
        return results

    @staticmethod
    async def _timed(coro) -> tuple[object, float]:
        """(result or exception, seconds it took); CancelledError propagates."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            return await coro, loop.time() - start
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the caller
            return exc, loop.time() - start

    def _next_replica(self, loc: ObjectLocation, attempt: list[int], i: int) -> ReplicaInfo | None:
        """The replica of ``loc`` to try next (from ``attempt[i]`` on), skipping suspect nodes."""
        while attempt[i] < len(loc.replicas):
            replica = loc.replicas[attempt[i]]
            if replica.endpoint not in self.suspects:
                return replica
            attempt[i] += 1
        return None

    async def write(self, tickets: list[PutTicket], srcs: list[np.ndarray]) -> list[PdError | None]:
        """Write each ``src`` to every replica of its ticket (one UCX request per node); per ticket None
        or the first error (a replica on a suspect node fails its ticket at once). Does not call
        PutEnd/PutRevoke."""
        results: list[PdError | None] = [None] * len(tickets)
        by_node: dict[str, list[tuple[int, int]]] = {}
        for i, (t, src) in enumerate(zip(tickets, srcs)):
            if src.nbytes != t.size:
                results[i] = StoreIOError(f"buffer of {src.nbytes} bytes for object {t.key} of {t.size} bytes")
                continue
            suspect = next((r.endpoint for r in t.replicas if r.endpoint in self.suspects), None)
            if suspect is not None:
                results[i] = StoreIOError(f"object {t.key} has a replica on {suspect}, a storage node that failed recently")
                continue
            for r in t.replicas:
                by_node.setdefault(r.endpoint, []).append((i, r.offset))
        nodes = list(by_node.items())
        outcomes = await asyncio.gather(
            *(self.data.write(ep, [(off, srcs[i]) for i, off in items], self.io_timeout_s) for ep, items in nodes),
            return_exceptions=True,
        )
        for (ep, items), outcome in zip(nodes, outcomes):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                err = outcome if isinstance(outcome, PdError) else StoreIOError(repr(outcome))
                self.suspects.mark(ep)
                for i, _off in items:
                    results[i] = results[i] or err
        return results

    async def put(self, keys: list[str], srcs: list[np.ndarray]) -> PutReport:
        """Two-phase put of a batch of equally sized objects. Keys that exist or are being written by
        another writer are skipped (``existed``); a key whose bytes could not be written is revoked."""
        report = PutReport()
        if not keys:
            return report
        size = srcs[0].nbytes
        tickets = await self.put_start(keys, size)
        return await self.finish_put(keys, tickets, srcs, report)

    async def finish_put(self, keys: list[str], tickets: list[PutTicket | PdError], srcs: list[np.ndarray],
                         report: PutReport | None = None) -> PutReport:
        """Second half of ``put`` for the per-key results of ``put_start`` (errors are only reported)."""
        report = report or PutReport()
        open_tickets, open_srcs = [], []
        for key, t, src in zip(keys, tickets, srcs):
            if isinstance(t, PutTicket):
                open_tickets.append(t)
                open_srcs.append(src)
            elif isinstance(t, ObjectAlreadyExists):
                report.existed.append(key)
            else:
                report.failed[key] = t
        if not open_tickets:
            return report
        try:
            write_errors = await self.write(open_tickets, open_srcs)
        except BaseException:
            await asyncio.shield(self.put_revoke(open_tickets))
            raise
        good = [(t, src) for t, src, e in zip(open_tickets, open_srcs, write_errors) if e is None]
        bad = [t for t, e in zip(open_tickets, write_errors) if e is not None]
        for t, e in zip(open_tickets, write_errors):
            if e is not None:
                report.failed[t.key] = e
        await self.put_revoke(bad)
        if good:
            end_errors = await self.put_end([t for t, _ in good], [checksum(src) for _, src in good])
            for (t, _src), e in zip(good, end_errors):
                if e is None:
                    report.written.append(t.key)
                else:
                    report.failed[t.key] = e
        return report
