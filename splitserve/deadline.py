"""Request deadlines: absolute times on the monotonic clock, handed to the next hop as remaining time.

A request that arrives with a deadline (gRPC ``context.time_remaining()``, or the HTTP front door's
optional request timeout) keeps it as an absolute ``time.monotonic()`` value; every call it makes to
another service gets the time left, never a fixed value. ``None`` means no deadline, and none is
imposed. Clocks are injectable so tests never sleep.
"""

from __future__ import annotations

import time
from typing import Callable

from splitserve.errors import DeadlineExceeded

Clock = Callable[[], float]


def deadline_after(timeout_s: float | None, clock: Clock = time.monotonic) -> float | None:
    """The absolute deadline ``timeout_s`` seconds from now, or None when ``timeout_s`` is None."""
    return None if timeout_s is None else clock() + timeout_s


def time_left(deadline: float | None, clock: Clock = time.monotonic) -> float | None:
    """Seconds until ``deadline`` (may be <= 0 once passed), or None without a deadline."""
    return None if deadline is None else deadline - clock()


def hop_timeout(deadline: float | None, cap_s: float | None = None, clock: Clock = time.monotonic) -> float | None:
    """Timeout for one call to another service: the time left, at most ``cap_s`` (a per-hop liveness
    guard; None = no cap). None when neither is set.

    Raises:
        DeadlineExceeded: the deadline has already passed.
    """
    left = time_left(deadline, clock)
    if left is not None and left <= 0:
        raise DeadlineExceeded("the request's deadline has passed")
    if left is None:
        return cap_s
    return left if cap_s is None else min(left, cap_s)
