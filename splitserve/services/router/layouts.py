"""The start-up check that every prefill/decode pair agrees on the KV layout (else KV cannot move between them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from pd.v1 import common_pb2

from splitserve.rpc.convert import layout_from_proto
from splitserve.services.router.registry import WorkerState
from splitserve.transfer.layout import KVLayout

logger = logging.getLogger(__name__)


async def check_layouts(prefill: Sequence[WorkerState], decode: Sequence[WorkerState], retry_s: float = 1.0) -> None:
    """Log an error for every prefill/decode pair whose KV layouts differ (requests to such a pair fail with
    FAILED_PRECONDITION). Asks each worker for its layout (GetKVLayout), every ``retry_s`` seconds for workers that
    are still starting; returns once all have answered."""
    workers = [*prefill, *decode]
    layouts: dict[str, KVLayout] = {}
    while len(layouts) < len(workers):
        for w in workers:
            if w.address in layouts:
                continue
            try:
                resp = await w.stub.GetKVLayout(common_pb2.GetKVLayoutRequest(), timeout=5)
                layouts[w.address] = layout_from_proto(resp.layout)
            except grpc.aio.AioRpcError:
                pass
        if len(layouts) < len(workers):
            await asyncio.sleep(retry_s)
    for p in prefill:
        for d in decode:
            if layouts[p.address] != layouts[d.address]:
                logger.error("KV layout of prefill %s [%s] differs from decode %s [%s]", p.address,
                             layouts[p.address].describe(), d.address, layouts[d.address].describe())
