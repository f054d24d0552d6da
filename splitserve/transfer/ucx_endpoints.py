"""Client-side UCX endpoints: one connected endpoint per peer ("host:port"), made on first use.

Concurrent users of a peer share one connect attempt, which outlives a user that gives up (its deadline
passed or it was cancelled), so a slow handshake is not restarted by every caller. A failed or aborted
endpoint is dropped and the next use reconnects. Used by the KV receiver (peers: prefill workers' KV
senders) and the KV store's data client (peers: storage nodes).
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.errors import KVTransferError
from splitserve.transfer import ucx_runtime
from splitserve.transfer.common import parse_endpoint
from splitserve.transfer.ucx_connect import create_endpoint
from splitserve.transfer.ucx_requests import abort_endpoint

logger = logging.getLogger("splitserve.transfer.ucx")


class EndpointCache:
    """Endpoints by peer key. Errors are ``error`` (a :class:`KVTransferError` subclass) naming the peer
    as ``peer_kind`` (e.g. "KV sender", "storage node").

    ``connect_timeout_s``: a peer that does not complete the handshake within this long counts as down
    (None: only the caller's deadline bounds it). :meth:`start` initialises UCX for the process (inside
    the running loop, which must then drive every transfer); :meth:`close` releases it.
    """

    def __init__(self, peer_kind: str, error: type[KVTransferError] = KVTransferError,
                 connect_timeout_s: float | None = None) -> None:
        self.peer_kind = peer_kind
        self.error = error
        self.connect_timeout_s = connect_timeout_s
        self.peers: dict[str, object] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self.started = False
        self.closed = False

    async def start(self) -> None:
        if self.started:
            return
        if self.closed:
            raise RuntimeError(f"connections to {self.peer_kind}s are closed")
        ucx_runtime.acquire()
        self.started = True

    async def get(self, key: str, deadline: float):
        """The endpoint to ``key``, connecting if needed by ``deadline`` (loop time). Raises ``error``."""
        if self.closed or not self.started:
            raise self.error(f"connections to {self.peer_kind}s are not started or closed")
        ep = self.peers.get(key)
        if ep is not None:
            if not ep.closed:
                return ep
            self.drop(key, ep)
        loop = asyncio.get_running_loop()
        remaining = max(deadline - loop.time(), 0.0)
        task = self._connecting.get(key)
        if task is None:
            host, port = parse_endpoint(key)
            timeout = max(remaining, 0.1) if self.connect_timeout_s is None else min(max(remaining, 0.1), self.connect_timeout_s)
            task = loop.create_task(self._connect(key, host, port, timeout))
            self._connecting[key] = task
            task.add_done_callback(lambda t, key=key: self._connected(key, t))
        wait_s = remaining if self.connect_timeout_s is None else min(remaining, self.connect_timeout_s + 0.5)
        try:
            return await asyncio.wait_for(asyncio.shield(task), wait_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise self.error(f"timed out connecting to {self.peer_kind} {key}") from None
        except KVTransferError:
            raise
        except Exception as exc:
            raise self.error(f"cannot connect to {self.peer_kind} {key}: {exc!r}") from exc

    def drop(self, key: str, ep, *, abort: bool = True) -> None:
        """Forget ``ep`` as the endpoint to ``key`` (if it still is) and, by default, abort it: every
        request posted on it is cancelled (other transfers on it fail; the next use reconnects)."""
        if self.peers.get(key) is ep:
            del self.peers[key]
        if abort:
            abort_endpoint(ep)

    async def close(self) -> None:
        """Abort every endpoint (transfers in flight see their requests cancelled) and connect attempt."""
        if self.closed:
            return
        self.closed = True
        for t in list(self._connecting.values()):
            t.cancel()
        for ep in list(self.peers.values()):
            abort_endpoint(ep)
        self.peers.clear()
        if self._connecting:
            await asyncio.wait(list(self._connecting.values()), timeout=1.0)
        if self.started:
            self.started = False
            ucx_runtime.release()

    async def _connect(self, key: str, host: str, port: int, timeout_s: float):
        ep = await create_endpoint(host, port, timeout_s)
        if self.closed:
            abort_endpoint(ep)
            raise self.error(f"connections to {self.peer_kind}s are closed")
        self.peers[key] = ep
        return ep

    def _connected(self, key: str, task: asyncio.Task) -> None:
        if self._connecting.get(key) is task:
            del self._connecting[key]
        if not task.cancelled():
            task.exception()
