"""Worker registry: which prefill/decode workers the router may use, whether they are up, and their load.

Design: the router *polls* its workers (``grpc.health.v1`` Check + ``GetStats``) every
``poll_interval_s`` instead of workers pushing Register/ReportLoad heartbeats. Why: every worker
already serves both RPCs, so no proto change and no worker-side code (the servicers stay untouched);
static lists from configuration are the registry's only input, so they keep working by construction;
and a poll that fails *is* a missed heartbeat, measured by the one process that acts on it (no clock
skew, no stale reports from a worker that can still send but not serve).

A worker is taken out of rotation after ``miss_limit`` consecutive failed polls, at once when it says
NOT_SERVING (it is draining for a shutdown), or at once when a request to it fails with UNAVAILABLE or
stalls (passive check: ``mark_failed``); it comes back on the first successful poll. Between polls the
router also counts what it has itself sent to each worker (``inflight_requests``,
``inflight_prefill_tokens``), so load-aware policies see bursts at once.

Roles: a worker born to one role (``--prefill`` / ``--decode`` addresses) keeps it. A worker whose role can change
(``--workers``: `splitserve worker`) is listed under both roles (two entries, one channel) and announces the work it
takes now in every GetStats answer (``role``); an entry is picked only while the worker's role takes its work
(:attr:`WorkerState.takes_work`), so the registry follows a switch on its next poll, or at once when this router
made it (:meth:`WorkerRegistry.set_worker_role`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from splitserve.rpc.convert import layout_from_proto
from splitserve.rpc.server import channel
from splitserve.rpc.tls import TlsConfig
from splitserve.services.router.background import cancel_and_wait
from splitserve.services.worker.roles import ROLE_FROM_PROTO, takes
from splitserve.telemetry.metrics import ROUTER_WORKER_UP
from splitserve.transfer.layout import KVLayout

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
_STUBS = {PREFILL: prefill_pb2_grpc.PrefillServiceStub, DECODE: decode_pb2_grpc.DecodeServiceStub}


@dataclass(eq=False)
class WorkerState:
    """One worker as the router sees it. ``stats`` are the worker's last GetStats counters."""

    address: str
    role: str  # "prefill" | "decode"
    channel: grpc.aio.Channel
    stub: object
    up: bool = False
    misses: int = 0
    last_ok: float | None = None  # monotonic seconds of the last successful poll
    last_error: str = ""
    layout: KVLayout | None = None
    kv_endpoint: str = ""  # a prefill worker's KV sender (host:port, as it advertises it): push subscriptions go there
    stats: dict[str, float] = field(default_factory=dict)
    inflight_requests: int = 0  # sent by this router and not finished
    inflight_prefill_tokens: int = 0  # uncached prompt tokens sent and not yet prefilled
    picks: int = 0
    elastic: bool = False  # listed by --workers: its role can change (pd.v1.RoleService)
    worker_role: str | None = None  # the role it announced ("prefill" | "decode" | "both"); None: born to ``role``
    draining_role: str | None = None  # the role it left whose calls still run

    @property
    def takes_work(self) -> bool:
        """The worker's current role takes this entry's work (``role``)."""
        return self.worker_role is None or takes(self.worker_role, self.role)

    @property
    def queued_prefill_tokens(self) -> int:
        return self.inflight_prefill_tokens

    @property
    def free_blocks(self) -> float:
        return self.stats.get("kv_blocks_free", 0.0)

    @property
    def running_requests(self) -> float:
        """Requests on the worker: the larger of its last report and what this router has in flight there."""
        reported = self.stats.get("requests_running", 0.0) + self.stats.get("requests_waiting", 0.0)
        return max(reported, float(self.inflight_requests))

    def describe(self, now: float) -> dict:
        return {
            "address": self.address, "role": self.role, "state": "up" if self.up else "down",
            "worker_role": self.worker_role, "draining_role": self.draining_role, "takes_work": self.takes_work,
            "elastic": self.elastic,
            "last_ok_s_ago": None if self.last_ok is None else round(now - self.last_ok, 3),
            "last_error": self.last_error or None,
            "kv_layout": self.layout.describe() if self.layout else None,
            "load": {
                "inflight_requests": self.inflight_requests,
                "queued_prefill_tokens": self.inflight_prefill_tokens,
                "requests_running": self.stats.get("requests_running"),
                "requests_waiting": self.stats.get("requests_waiting"),
                "kv_blocks_free": self.stats.get("kv_blocks_free"),
                "kv_blocks_total": self.stats.get("kv_blocks_total"),
            },
            "picks": self.picks,
        }


class _NotServing(RuntimeError):
    """The worker answered its health check with a status other than SERVING (e.g. draining)."""


class WorkerRegistry:
    """Prefill and decode workers from static address lists, kept up to date by a poll loop.

    Args:
        prefill / decode: ``host:port`` gRPC addresses of workers born to that role.
        workers: ``host:port`` addresses of workers whose role can change (listed under both roles).
        poll_interval_s: seconds between polls of each worker.
        poll_timeout_s: deadline of one health/stats call.
        miss_limit: consecutive failed polls before a worker is taken out of rotation.
        clock: monotonic seconds (injectable for tests).
    Raises:
        ValueError: no prefill or no decode address, or a non-positive interval/limit.
    """

    def __init__(self, prefill: list[str], decode: list[str], *, poll_interval_s: float = 1.0, poll_timeout_s: float = 2.0,
                 miss_limit: int = 2, clock: Callable[[], float] = time.monotonic,
                 tls: TlsConfig | None = None, workers: list[str] = ()) -> None:
        if not (prefill or workers) or not (decode or workers):
            raise ValueError("need at least one prefill and one decode worker address")
        if poll_interval_s <= 0 or poll_timeout_s <= 0 or miss_limit < 1:
            raise ValueError("poll_interval_s and poll_timeout_s must be > 0 and miss_limit >= 1")
        self.poll_interval_s, self.poll_timeout_s, self.miss_limit, self.clock = poll_interval_s, poll_timeout_s, miss_limit, clock
        self.workers: dict[str, list[WorkerState]] = {PREFILL: [], DECODE: []}
        for role, addrs in ((PREFILL, prefill), (DECODE, decode)):
            for a in addrs:
                ch = channel(a, tls)
                self.workers[role].append(WorkerState(a, role, ch, _STUBS[role](ch)))
        for a in workers:  # one channel, an entry per role
            ch = channel(a, tls)
            for role in (PREFILL, DECODE):
                self.workers[role].append(WorkerState(a, role, ch, _STUBS[role](ch), elastic=True))
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    def all(self) -> list[WorkerState]:
        return self.workers[PREFILL] + self.workers[DECODE]

    def up(self, role: str) -> list[WorkerState]:
        """Workers of ``role`` in rotation now (up, and their current role takes that work)."""
        return [w for w in self.workers[role] if w.up and w.takes_work]

    def set_worker_role(self, address: str, role: str | None, draining: str | None = None) -> None:
        """Every entry of the worker at ``address`` follows its role ``role`` (None: born to its entries' role)."""
        for w in self.all():
            if w.address == address:
                self._set_role(w, role, draining)

    def _set_role(self, w: WorkerState, role: str | None, draining: str | None) -> None:
        if role != w.worker_role:
            before = w.takes_work
            w.worker_role = role
            if w.takes_work != before:
                logger.info("worker %s is a %s worker now: %s %s work", w.address, role, "takes" if w.takes_work else "takes no",
                            w.role)
                self._changed.set()
        w.draining_role = draining

    def _set(self, w: WorkerState, up: bool, error: str = "") -> None:
        if up != w.up:
            logger.log(logging.INFO if up else logging.WARNING, "%s worker %s is %s%s", w.role, w.address, "up" if up else "DOWN",
                       f" ({error})" if error else "")
            self._changed.set()
        w.up = up
        ROUTER_WORKER_UP.labels(w.role, w.address).set(1 if up else 0)

    async def poll_once(self, w: WorkerState) -> bool:
        """One heartbeat of ``w``: health Check, then GetStats (and its KV layout until known)."""
        try:
            r = await health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(), timeout=self.poll_timeout_s)
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                raise _NotServing(f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}")
            stats = await w.stub.GetStats(common_pb2.GetStatsRequest(), timeout=self.poll_timeout_s)
            if w.layout is None:
                info = await w.stub.GetKVLayout(common_pb2.GetKVLayoutRequest(), timeout=self.poll_timeout_s)
                w.layout, w.kv_endpoint = layout_from_proto(info.layout), info.kv_endpoint
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            w.misses += 1
            w.last_error = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if w.misses >= self.miss_limit or not w.up or isinstance(exc, _NotServing):  # NOT_SERVING: no new work
                self._set(w, False, w.last_error)
            return False
        w.stats = dict(stats.counters)
        self._set_role(w, ROLE_FROM_PROTO.get(stats.role), ROLE_FROM_PROTO.get(stats.draining_role))
        w.misses, w.last_ok, w.last_error = 0, self.clock(), ""
        self._set(w, True)
        return True

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll_once(w) for w in self.all()))

    def mark_failed(self, w: WorkerState, error: str) -> None:
        """A request found ``w`` unreachable: out of rotation now; the poll loop brings it back."""
        w.last_error = error
        w.misses = max(w.misses, self.miss_limit)
        self._set(w, False, error)

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_all()
            except Exception:  # never let the heartbeat loop die
                logger.exception("worker poll failed")
            await asyncio.sleep(self.poll_interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def wait_for(self, role: str, timeout_s: float) -> list[WorkerState]:
        """Workers of ``role`` that are up, waiting up to ``timeout_s`` for one to come up."""
        deadline = self.clock() + timeout_s
        while not self.up(role) and self.clock() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(self.poll_interval_s, max(deadline - self.clock(), 0.001)))
            except asyncio.TimeoutError:
                pass
        return self.up(role)

    def snapshot(self) -> list[dict]:
        now = self.clock()
        return [w.describe(now) for w in self.all()]

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        for w in self.all():
            await w.channel.close()
