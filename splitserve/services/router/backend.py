"""What every router backend shares: the KV layout check at start-up, stats, and releasing KV that no decode
worker will pull.

The request path (routing, failover, retries, deadlines) is :class:`~splitserve.services.router.failover.RoutedBackend`,
which builds on this class.

* KV that the prefill worker holds for a decode leg that never started, or that the decode worker recomputed
  instead of pulling (``kv_recomputed``), is released at once (ReleaseKV, in the background, so it survives the
  request's cancellation); otherwise the prefill worker's lease frees it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Protocol

import grpc
from pd.v1 import common_pb2, prefill_pb2

from splitserve.rpc.convert import layout_from_proto

logger = logging.getLogger(__name__)


class _Worker(Protocol):
    address: str
    stub: object


class DisaggregatedBackend:
    """Base of the router's GenerationBackend. Subclasses set ``prefill_workers`` and ``decode_workers`` (objects
    with ``address`` and ``stub``), ``counters`` (a Counter), ``streams_open`` and ``_background`` (a set of tasks)."""

    prefill_workers: list[_Worker]
    decode_workers: list[_Worker]
    counters: Counter[str]
    streams_open: int
    _background: set[asyncio.Task]

    async def check_layouts(self, retry_s: float = 1.0) -> None:
        """Log an error for every prefill/decode pair whose KV layouts differ (requests to such a pair
        fail with FAILED_PRECONDITION). Retries workers that are still starting."""
        layouts = {}
        while len(layouts) < len(self.prefill_workers) + len(self.decode_workers):
            for w in self.prefill_workers + self.decode_workers:
                if w.address in layouts:
                    continue
                try:
                    resp = await w.stub.GetKVLayout(common_pb2.GetKVLayoutRequest(), timeout=5)
                    layouts[w.address] = layout_from_proto(resp.layout)
                except grpc.aio.AioRpcError:
                    pass
            if len(layouts) < len(self.prefill_workers) + len(self.decode_workers):
                await asyncio.sleep(retry_s)
        for p in self.prefill_workers:
            for d in self.decode_workers:
                if layouts[p.address] != layouts[d.address]:
                    logger.error("KV layout of prefill %s [%s] differs from decode %s [%s]", p.address,
                                 layouts[p.address].describe(), d.address, layouts[d.address].describe())

    def stats(self) -> dict[str, float]:
        return {"streams_open": self.streams_open, "background_tasks": len(self._background), **self.counters}

    def _release_soon(self, prefill: _Worker, transfer_id: str) -> None:
        """Tell the prefill worker to free KV no decode worker will pull (best effort, in the background)."""
        task = asyncio.get_running_loop().create_task(self._release(prefill, transfer_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, prefill: _Worker, transfer_id: str) -> None:
        try:
            resp = await prefill.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(transfer_id=transfer_id), timeout=5)
            if resp.released:
                self.counters["kv_released"] += 1
        except grpc.aio.AioRpcError as exc:
            logger.warning("could not release KV %s on %s: %s", transfer_id, prefill.address, exc.code().name)
        except Exception as exc:  # e.g. the channel was closed at shutdown; the lease frees the KV
            logger.warning("could not release KV %s on %s: %r", transfer_id, prefill.address, exc)
