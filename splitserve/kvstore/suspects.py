"""Storage nodes a client saw fail recently (a circuit breaker on the data plane).

A node that reset, refused or timed out a read or write is *suspect* for ``hold_s``: reads and writes skip
it (a read uses another replica or fails at once, so the caller recomputes instead of waiting for the I/O
timeout again; a write is revoked at once). That covers the time until the master, after its heartbeat
timeout, stops listing a dead or hung node. After ``hold_s`` the node is tried again.
"""

from __future__ import annotations

import time
from typing import Callable


class SuspectNodes:
    """Endpoints under suspicion; ``clock`` is monotonic seconds (injectable)."""

    def __init__(self, hold_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self.clock = clock
        self._until: dict[str, float] = {}

    def mark(self, endpoint: str) -> None:
        self._until[endpoint] = self.clock() + self.hold_s

    def __contains__(self, endpoint: str) -> bool:
        until = self._until.get(endpoint)
        if until is None:
            return False
        if until <= self.clock():
            del self._until[endpoint]
            return False
        return True

    def __len__(self) -> int:
        now = self.clock()
        return sum(until > now for until in self._until.values())
