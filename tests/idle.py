"""The one definition of "idle" (no leaked KV blocks, nothing in flight) and the polling helpers the tests share.

A worker is idle when every KV block of its pool is free and none of :data:`WORKER_BUSY` is above 0 (requests
running or waiting, block allocations waiting, open streams, prefills in flight, KV transfers held for a decode
worker, KV store writes in flight). A router is idle when none of :data:`ROUTER_BUSY` is above 0. A counter a
process does not report counts as 0.

``wait_idle`` / ``wait_idle_sync`` poll a ``read`` callable that returns ``(workers, router)``: the GetStats
counters of each worker by name, and the router's counters (or None when there is no router to check). They
return the seconds it took and raise AssertionError with what was still busy after ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

WORKER_BUSY = ("requests_running", "requests_waiting", "kv_allocations_waiting", "streams_open", "prefills_in_flight",
               "kv_transfers_held", "kvstore_writes_in_flight")
ROUTER_BUSY = ("streams_open", "grpc_streams_open", "background_tasks")

Counters = Mapping[str, float]
Reading = tuple[Mapping[str, Counters], Counters | None]


def worker_busy(stats: Counters) -> dict[str, float]:
    """What keeps a worker from idle: ``kv_blocks_used`` (blocks not free) and each busy counter above 0."""
    busy = {k: stats[k] for k in WORKER_BUSY if stats.get(k, 0) > 0}
    used = stats["kv_blocks_total"] - stats["kv_blocks_free"]
    if used:
        busy["kv_blocks_used"] = used
    return busy


def router_busy(stats: Counters) -> dict[str, float]:
    """Each router counter of :data:`ROUTER_BUSY` above 0."""
    return {k: stats[k] for k in ROUTER_BUSY if stats.get(k, 0) > 0}


def busy_report(workers: Mapping[str, Counters], router: Counters | None = None) -> dict[str, dict[str, float]]:
    """``{process name: what is still busy}`` for every process that is not idle; empty when all are."""
    report = {name: busy for name, s in workers.items() if (busy := worker_busy(s))}
    if router is not None and (busy := router_busy(router)):
        report["router"] = busy
    return report


async def wait_idle(read: Callable[[], Awaitable[Reading]], timeout_s: float, poll_s: float = 0.05) -> float:
    """Poll ``await read()`` until every process is idle; seconds waited. Raises AssertionError after ``timeout_s``,
    naming what was still busy."""
    report: dict = {}

    async def idle() -> bool:
        report.clear()
        report.update(busy_report(*await read()))
        return not report

    try:
        return await wait_until("every process back to idle", idle, timeout_s, poll_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still busy: {report}") from None


def wait_idle_sync(read: Callable[[], Reading], timeout_s: float, poll_s: float = 0.05) -> float:
    """:func:`wait_idle` for a blocking ``read``."""
    report: dict = {}

    def idle() -> bool:
        report.clear()
        report.update(busy_report(*read()))
        return not report

    try:
        return wait_until_sync("every process back to idle", idle, timeout_s, poll_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still busy: {report}") from None


async def wait_until(what: str, predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.05) -> float:
    """Poll ``predicate()`` (sync, or a coroutine function) until it is true; seconds waited.

    Raises:
        AssertionError: ``what`` is still not true after ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return loop.time() - t0
        if loop.time() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(poll_s)


def engine_stats(**engines) -> Callable[[], Awaitable[Reading]]:
    """A ``read`` for :func:`wait_idle` over in-process engines (``AsyncEngine.stats()``), by keyword name."""

    async def read() -> Reading:
        return {name: await engine.stats() for name, engine in engines.items()}, None

    return read


def wait_until_sync(what: str, predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.05) -> float:
    """:func:`wait_until` for a blocking ``predicate``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - t0
