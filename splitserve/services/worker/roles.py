"""Role as state: which work a worker takes now (prefill, decode or both), and its calls in flight per kind of work.

Lifecycle of a switch (:meth:`RoleState.set`, the ``pd.v1.RoleService/SetRole`` RPC):
1. The new role takes effect at once: calls of the work it takes are admitted from now on (one engine and one
   KV cache serve both kinds of work, so nothing has to wait for the old role's calls).
2. For ``grace_s`` (``--role-switch-grace-s``) the worker still admits calls of the role it left: routers that
   have not polled it since the switch still send them, and the one engine can serve them (a lame-duck period, so
   that no request fails because a router learned late). Afterwards new calls of the work it no longer takes are
   refused with :class:`~splitserve.errors.RoleNotServed` (ABORTED): the router tries another worker and keeps
   this one in rotation.
3. Calls of the role left that were admitted run to their end (the role is *draining* until the grace period is
   over and the last one has ended); KV a prefill left held for a decode worker is still served by the KV sender.
4. ``GetStats`` announces ``role`` and ``draining_role`` at once; the router's registry follows on its next poll.

No gRPC and no torch here: the router imports the role names and their proto values too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from pd.v1 import common_pb2

from splitserve.errors import RoleNotServed

logger = logging.getLogger(__name__)

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
WORK = (PREFILL, DECODE)  # the kinds of work a call can be

ROLE_TO_PROTO = {PREFILL: common_pb2.WORKER_ROLE_PREFILL, DECODE: common_pb2.WORKER_ROLE_DECODE, BOTH: common_pb2.WORKER_ROLE_BOTH}
ROLE_FROM_PROTO: dict[int, str | None] = {v: k for k, v in ROLE_TO_PROTO.items()} | {common_pb2.WORKER_ROLE_UNSPECIFIED: None}

_POLL_S = 0.02


def takes(role: str, work: str) -> bool:
    """Whether a worker in ``role`` takes new calls of ``work`` ("prefill" or "decode")."""
    return role == BOTH or role == work


def check_role(role: str) -> str:
    """``role`` if it is one of :data:`ROLES`; raises ValueError naming them otherwise."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


class RoleState:
    """The role of one worker process (event-loop thread only). ``grace_s``: seconds the role left is still admitted
    after a switch; ``clock``: monotonic seconds (injectable for tests).

    Attributes:
        role: "prefill" | "decode" | "both".
        calls: calls in flight per kind of work (Prefill calls; Decode streams).
        switches: role changes since start.
        refused: calls refused per kind of work because the role did not take it.
    Raises:
        ValueError: an unknown role or a negative grace period.
    """

    def __init__(self, role: str, grace_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not grace_s >= 0:
            raise ValueError(f"role switch grace must be >= 0 s, got {grace_s}")
        self.role = check_role(role)
        self.grace_s = grace_s
        self.clock = clock
        self._grace_work: frozenset[str] = frozenset()  # work the previous role took, admitted until _grace_until
        self._grace_until = 0.0
        self.calls = {PREFILL: 0, DECODE: 0}
        self.refused = {PREFILL: 0, DECODE: 0}
        self.switches = 0

    def takes(self, work: str) -> bool:
        """Whether the current role takes ``work`` (what the worker announces)."""
        return takes(self.role, work)

    def _in_grace(self, work: str) -> bool:
        return work in self._grace_work and self.clock() < self._grace_until

    def admits(self, work: str) -> bool:
        """Whether a new call of ``work`` is admitted now: the role takes it, or the role left it less than
        ``grace_s`` ago."""
        return self.takes(work) or self._in_grace(work)

    @property
    def draining(self) -> str | None:
        """The kind of work the role left that is still admitted (grace period) or whose calls are still running;
        None when there is none."""
        return next((w for w in WORK if not self.takes(w) and (self.calls[w] > 0 or self._in_grace(w))), None)

    def enter(self, work: str) -> None:
        """Count one new call of ``work`` in. Raises RoleNotServed (nothing counted) when it is not admitted."""
        if not self.admits(work):
            self.refused[work] += 1
            raise RoleNotServed(f"this worker is a {self.role} worker now: it takes no new {work} calls")
        self.calls[work] += 1

    def exit(self, work: str) -> None:
        """One call of ``work`` that :meth:`enter` admitted has ended."""
        self.calls[work] -= 1

    def set(self, role: str, reason: str = "") -> str:
        """Switch to ``role`` now (steps 1-3 of the module docstring); returns the previous role. Raises ValueError."""
        previous, self.role = self.role, check_role(role)
        if role != previous:
            self.switches += 1
            self._grace_work = frozenset(w for w in WORK if takes(previous, w) or self._in_grace(w))
            self._grace_until = self.clock() + self.grace_s
            left = self.draining
            logger.info("role %s -> %s%s%s", previous, role, f" ({reason})" if reason else "",
                        f"; draining {self.calls[left]} {left} call(s)" if left else "")
        return previous

    async def wait_drained(self, timeout_s: float) -> bool:
        """Wait until the role left is drained (grace period over, none of its calls running), at most
        ``timeout_s`` seconds. Returns True when drained."""
        end = self.clock() + timeout_s
        while self.draining is not None:
            if self.clock() >= end:
                return False
            await asyncio.sleep(min(_POLL_S, max(end - self.clock(), 0.0)))
        return True

    def counters(self) -> dict[str, float]:
        """For GetStats: role flags, calls per kind, switches and refusals."""
        return {
            "role_takes_prefill": float(self.takes(PREFILL)), "role_takes_decode": float(self.takes(DECODE)),
            "role_prefill_calls": self.calls[PREFILL], "role_decode_calls": self.calls[DECODE],
            "role_switches": self.switches, "role_refused_prefill": self.refused[PREFILL],
            "role_refused_decode": self.refused[DECODE],
        }

    def fill(self, response: common_pb2.GetStatsResponse) -> common_pb2.GetStatsResponse:
        """Announce the role in a GetStats ``response`` (``role``, ``draining_role``, :meth:`counters`)."""
        response.role = ROLE_TO_PROTO[self.role]
        left = self.draining
        response.draining_role = ROLE_TO_PROTO[left] if left else common_pb2.WORKER_ROLE_UNSPECIFIED
        response.counters.update(self.counters())
        return response
