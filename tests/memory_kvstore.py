"""An in-memory stand-in for ``KVStoreClient`` (the calls ``KVBlockStore`` and the workers make): objects in
a dict, no master, no UCX. Lets the prefill/decode worker tests run the KV store paths in one process."""

from __future__ import annotations

import asyncio

import numpy as np

from splitserve.errors import NoStorageNode, ObjectAlreadyExists, ObjectNotFound, ObjectNotReady, StoreIOError
from splitserve.kvstore.client import ObjectLocation, PutReport, PutTicket


class _DataCounters:
    bytes_read = 0
    bytes_written = 0


class MemoryStoreClient:
    """``objects[key]`` is the object's bytes, or None while it is being written (PROCESSING).

    Fault injection: ``fail_put_start`` (PutStart raises NoStorageNode), ``fail_reads`` (every read fails),
    ``put_start_gate`` (an asyncio.Event PutStart waits for)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes | None] = {}
        self.data = _DataCounters()
        self.fail_put_start = False
        self.fail_reads = False
        self.put_start_gate: asyncio.Event | None = None
        self.put_starts = 0  # PutStart calls begun

    async def lookup(self, keys: list[str], *, prefix: bool = False) -> list:
        out: list = []
        for key in keys:
            if key not in self.objects:
                out.append(ObjectNotFound(key))
            elif self.objects[key] is None:
                out.append(ObjectNotReady(key))
            else:
                out.append(ObjectLocation(key, len(self.objects[key]), 0, (), float("inf")))
            if prefix and not isinstance(out[-1], ObjectLocation):
                break
        return out

    async def read(self, locations: list[ObjectLocation], dsts: list[np.ndarray], timeout_s: float | None = None) -> list:
        out: list = []
        for loc, dst in zip(locations, dsts):
            if self.fail_reads:
                out.append(StoreIOError(f"injected read failure of {loc.key}"))
                continue
            dst[:] = np.frombuffer(self.objects[loc.key], dtype=np.uint8)
            self.data.bytes_read += dst.nbytes
            out.append(None)
        return out

    async def put_start(self, keys: list[str], size: int) -> list:
        self.put_starts += 1
        if self.put_start_gate is not None:
            await self.put_start_gate.wait()
        if self.fail_put_start:
            raise NoStorageNode("injected: no storage node")
        out: list = []
        for i, key in enumerate(keys):
            if key in self.objects:
                out.append(ObjectAlreadyExists(key))
            else:
                self.objects[key] = None
                out.append(PutTicket(key, i, size, ()))
        return out

    async def finish_put(self, keys: list[str], tickets: list, srcs: list[np.ndarray]) -> PutReport:
        report = PutReport()
        for key, ticket, src in zip(keys, tickets, srcs):
            if isinstance(ticket, PutTicket):
                self.objects[key] = src.tobytes()
                self.data.bytes_written += src.nbytes
                report.written.append(key)
            elif isinstance(ticket, ObjectAlreadyExists):
                report.existed.append(key)
            else:
                report.failed[key] = ticket
        return report

    async def remove(self, key: str, *, ignore_lease: bool = False) -> None:
        if key not in self.objects:
            raise ObjectNotFound(key)
        del self.objects[key]
