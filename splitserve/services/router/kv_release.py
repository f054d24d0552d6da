"""Releasing KV that no decode worker will pull (ReleaseKV to the prefill worker, in the background).

A prefill worker holds a request's KV blocks under a lease until a decode worker pulls them. When the decode leg
never starts (every decode worker failed, the client left, the deadline passed) or the decode worker recomputed the
prompt instead of pulling (``kv_recomputed``), the router tells the prefill worker at once instead of letting the
lease run out. The call runs as a background task so that it survives the cancellation of the request that asked
for it; it is best effort (a failure is logged and the lease frees the KV).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import grpc
from pd.v1 import prefill_pb2

from splitserve.services.router.registry import WorkerState

logger = logging.getLogger(__name__)


class KVRelease:
    """Background ReleaseKV calls of one router.

    Args:
        counters: the router's counters; ``kv_released`` counts KV the prefill worker confirmed it freed.
    """

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self.tasks: set[asyncio.Task] = set()

    def soon(self, prefill: WorkerState, transfer_id: str) -> None:
        """Ask ``prefill`` to free the KV of ``transfer_id`` (a background task: returns at once)."""
        task = asyncio.get_running_loop().create_task(self._release(prefill, transfer_id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` seconds for the calls in flight (at shutdown)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)

    async def _release(self, prefill: WorkerState, transfer_id: str) -> None:
        try:
            resp = await prefill.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=transfer_id), timeout=5)
            if resp.released:
                self.counters["kv_released"] += 1
        except grpc.aio.AioRpcError as exc:
            logger.warning("could not release KV %s on %s: %s", transfer_id, prefill.address, exc.code().name)
        except Exception as exc:  # e.g. the channel was closed at shutdown; the lease frees the KV
            logger.warning("could not release KV %s on %s: %r", transfer_id, prefill.address, exc)
