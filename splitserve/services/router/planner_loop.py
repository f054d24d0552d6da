"""The planner in the router process (``--planner``): every ``interval_s`` it reads the signals
(:mod:`.planner_signals`), asks :class:`~.planner.PlannerCore` for a decision and carries out a flip.

A flip takes the worker out of rotation for the role it leaves in this router's registry first (no new request is
sent there), then calls ``pd.v1.RoleService/SetRole`` on the worker; if that call fails the registry returns to the
worker's last announced role (its next poll settles it). Every decision updates the planner's metrics; a flip, a
failed flip and each change of what the planner wants are logged; the last decisions are in ``GET /v1/workers``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable

import grpc
from pd.v1 import role_pb2, role_pb2_grpc

from splitserve.services.router.background import cancel_and_wait
from splitserve.services.router.planner import Decision, PlannerConfig, PlannerCore, PoolWorker
from splitserve.services.router.planner_signals import HistogramWindow, Signals, registry_load
from splitserve.services.router.registry import PREFILL, WorkerRegistry
from splitserve.services.worker.roles import ROLE_TO_PROTO
from splitserve.telemetry import metrics as m

logger = logging.getLogger(__name__)

SET_ROLE_TIMEOUT_S = 5.0


def pool_of(registry: WorkerRegistry) -> list[PoolWorker]:
    """One :class:`PoolWorker` per worker address (a worker whose role can change has an entry per role)."""
    entries: dict[str, list] = {}
    for w in registry.all():
        entries.setdefault(w.address, []).append(w)
    pool = []
    for address, es in entries.items():
        first = es[0]
        role = first.worker_role or first.role
        load = first.queued_prefill_tokens if role == PREFILL else max(e.running_requests for e in es)
        pool.append(PoolWorker(address, role, first.elastic, all(e.up for e in es), first.draining_role is not None, float(load)))
    return pool


class Planner:
    """Runs :class:`PlannerCore` over ``registry`` (see the module docstring). ``clock``: monotonic seconds."""

    def __init__(self, registry: WorkerRegistry, config: PlannerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.config, self.clock = registry, config, clock
        self.core = PlannerCore(config, clock)
        self.ttft = HistogramWindow(m.TIME_TO_FIRST_TOKEN, config.window_s, clock)
        self.itl = HistogramWindow(m.INTER_TOKEN_LATENCY, config.window_s, clock)
        self.last: Decision | None = None
        self.log: deque[Decision] = deque(maxlen=32)  # flips and changes of want, newest last
        self.flip_log: deque[Decision] = deque(maxlen=256)  # flips only
        self.flips = 0
        self.started = clock()  # decisions' times in describe() count from here
        self._task: asyncio.Task | None = None

    def signals(self) -> Signals:
        self.ttft.sample()
        self.itl.sample()
        queued, running = registry_load(self.registry)
        q = self.config.quantile
        return Signals(queued, running, self.ttft.quantile(q), self.itl.quantile(q))

    async def tick(self) -> Decision:
        """One decision, carried out."""
        d = self.core.decide(self.signals(), pool_of(self.registry))
        if self.last is None or d.want != self.last.want:
            logger.info("planner: %s", f"wants one more {d.want} worker: {d.reason}" if d.want else "wants no change")
            self.log.append(d)
        self.last = d
        for role in d.loads:
            m.PLANNER_LOAD.labels(role).set(d.loads[role])
            m.PLANNER_WORKERS.labels(role).set(d.workers[role])
            m.PLANNER_DESIRED_WORKERS.labels(role).set(d.desired[role])
        action = d.action
        if action in ("flip", "revert") and not await self._flip(d):
            action = "flip_failed"
        m.PLANNER_DECISIONS.labels(action).inc()
        return d

    async def _flip(self, d: Decision) -> bool:
        entry = next(w for w in self.registry.all() if w.address == d.address)
        self.registry.set_worker_role(d.address, d.to_role, d.from_role)  # no new request of the role it leaves
        try:
            resp = await role_pb2_grpc.RoleServiceStub(entry.channel).SetRole(
                role_pb2.SetRoleRequest(role=ROLE_TO_PROTO[d.to_role], reason=f"planner: {d.reason}"), timeout=SET_ROLE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.registry.set_worker_role(d.address, d.from_role)
            logger.warning("planner: switching %s from %s to %s failed: %s", d.address, d.from_role, d.to_role, exc.code().name)
            return False
        self.flips += 1
        self.log.append(d)
        self.flip_log.append(d)
        m.PLANNER_ROLE_SWITCHES.labels(d.from_role, d.to_role).inc()
        after = {r: n + (1 if r == d.to_role else -1) for r, n in d.workers.items()}
        logger.info("planner: switched %s from %s to %s (%s; workers prefill:decode %d:%d -> %d:%d; %d draining call(s))",
                    d.address, d.from_role, d.to_role, d.reason, d.workers["prefill"], d.workers["decode"],
                    after["prefill"], after["decode"], resp.draining_calls)
        return True

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # never let the planner die
                logger.exception("planner tick failed")
            await asyncio.sleep(self.config.interval_s)

    def start(self) -> None:
        if self._task is None:
            logger.info("planner on: %s", self.config)
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    def describe(self) -> dict:
        """For ``GET /v1/workers``: the knobs, the last decision, the number of flips, the recent decisions (flips and
        changes of want) and the flips (the last 256)."""
        c = self.config
        return {
            "config": {"slo_ttft_ms": c.slo_ttft_ms, "slo_itl_ms": c.slo_itl_ms, "quantile": c.quantile,
                       "queued_tokens_per_worker": c.queued_tokens_per_worker, "running_per_worker": c.running_per_worker,
                       "window_s": c.window_s, "cooldown_s": c.cooldown_s, "interval_s": c.interval_s, "margin": c.margin,
                       "revert_tolerance": c.revert_tolerance},
            "last": self.last.describe(self.started) if self.last else None,
            "flips": self.flips,
            "recent": [d.describe(self.started) for d in self.log],
            "flip_log": [d.describe(self.started) for d in self.flip_log],
        }
