"""The storage node's data plane: serves reads and writes of byte ranges of its segment over UCX.

Per request (:mod:`splitserve.kvstore.wire`): the client posts its receives, then sends one REQUEST
active message. READ: the node answers STATUS and, on OK, each range straight from the segment (zero
copies in splitserve: UCX reads the segment memory); on refusal it sends an empty message per range so
the client's posted receives complete without touching its buffers. WRITE: the client sends each range
right after the request; the node posts receives straight into the segment and answers STATUS once all
arrived (or FAILED after ``io_timeout_s``, aborting the connection so nothing arrives later). A refused
WRITE is answered at once; the client then aborts its endpoint, which cancels its sends.

The node knows nothing of objects: the master decides which ranges hold what, and readers verify a
checksum, so a late write into reused space (a reclaimed zombie write) is detected, never served silently.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass

import numpy as np

from splitserve.kvstore import wire
from splitserve.transfer.common import advertise_host, format_endpoint
from splitserve.transfer.ucx_listener import UcxServer
from splitserve.transfer.ucx_requests import Posted, connection_tag

logger = logging.getLogger("splitserve.kvstore.node")

_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass
class SegmentStats:
    bytes_read: int = 0  # bytes served to readers
    bytes_written: int = 0  # bytes received from writers
    reads: int = 0
    writes: int = 0
    refused: int = 0
    failed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SegmentServer:
    """A ``nbytes`` memory segment behind a UCX listener. Start and use it on one event loop."""

    def __init__(self, nbytes: int, *, host: str = "127.0.0.1", port: int = 0, io_timeout_s: float = 30.0) -> None:
        if nbytes < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {nbytes}")
        self.nbytes = nbytes
        self.segment = np.empty(nbytes, dtype=np.uint8)
        self.segment.fill(0)  # touch every page now, not during the first transfers
        self._host = advertise_host(host)
        self._io_timeout_s = float(io_timeout_s)
        self._server = UcxServer(self._dispatch, wire.decode_request, port=port, name="storage node", drain_s=self._io_timeout_s)
        self.stats = SegmentStats()

    async def start(self) -> None:
        await self._server.start()
        logger.info("segment of %d bytes served over UCX at %s", self.nbytes, self.endpoint)

    @property
    def endpoint(self) -> str:
        return format_endpoint(self._host, self._server.port)

    async def close(self) -> None:
        await self._server.close()  # aborts every connection: posted sends/receives are cancelled

    # ---------------------------------------------------------------- requests
    def _dispatch(self, ep, req: wire.Request) -> bool:
        self._server.spawn(ep, self._serve(ep, req))
        return True

    async def _serve(self, ep, req: wire.Request) -> None:
        if self._server.closing:
            status, detail = wire.Status.CLOSING, "storage node is closing"
        else:
            detail = wire.check_ranges(req.ranges, self.nbytes)
            status = wire.Status.INVALID if detail else wire.Status.OK
        if status is not wire.Status.OK:
            self.stats.refused += 1
        try:
            if req.op is wire.Op.READ:
                await self._serve_read(ep, req, status, detail)
            else:
                await self._serve_write(ep, req, status, detail)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            self.stats.failed += 1
            logger.info("store %s request %d failed: %s", req.op.name, req.req_id, exc)

    async def _serve_read(self, ep, req: wire.Request, status: wire.Status, detail: str) -> None:
        posted = Posted(ep)
        posted.send(wire.encode_status(status, detail), connection_tag(ep, wire.tag(req.req_id, 0), outgoing=True))
        for i, (offset, nbytes) in enumerate(req.ranges):
            buf = self.segment[offset : offset + nbytes] if status is wire.Status.OK else _EMPTY
            posted.send(buf, connection_tag(ep, wire.tag(req.req_id, 1 + i), outgoing=True))
        if await self._settle(ep, posted) and status is wire.Status.OK:
            self.stats.reads += 1
            self.stats.bytes_read += sum(n for _o, n in req.ranges)

    async def _serve_write(self, ep, req: wire.Request, status: wire.Status, detail: str) -> None:
        if status is wire.Status.OK:
            posted = Posted(ep)
            for i, (offset, nbytes) in enumerate(req.ranges):
                tag = connection_tag(ep, wire.tag(req.req_id, 1 + i), outgoing=False)
                posted.recv(self.segment[offset : offset + nbytes], tag)
            if not await self._settle(ep, posted):
                self.stats.failed += 1
                return  # the endpoint is aborted: the client sees the connection fail
            self.stats.writes += 1
            self.stats.bytes_written += sum(n for _o, n in req.ranges)
        reply = Posted(ep)
        reply.send(wire.encode_status(status, detail), connection_tag(ep, wire.tag(req.req_id, 0), outgoing=True))
        await self._settle(ep, reply)

    async def _settle(self, ep, posted: Posted) -> bool:
        """Wait for ``posted`` up to the I/O timeout; on failure abort ``ep`` so nothing stays posted."""
        return await posted.settle(self._io_timeout_s, lambda: self._server.forget(ep))
