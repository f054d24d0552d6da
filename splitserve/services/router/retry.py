"""Which failed worker calls the router may try again elsewhere, and which take the worker out of rotation."""

from __future__ import annotations

import grpc

from splitserve.deadline import time_left

RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
})
"""Codes after which the same request may be tried on another worker (nothing reached the client yet)."""

DOWN = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Codes that say the worker itself is unreachable: it leaves the rotation at once."""


def retryable(code: grpc.StatusCode, deadline: float | None) -> bool:
    """True when a call that failed with ``code`` may be tried elsewhere: a :data:`RETRYABLE` code and time left
    before ``deadline`` (absolute ``time.monotonic()`` seconds; None: no deadline)."""
    left = time_left(deadline)
    return code in RETRYABLE and (left is None or left > 0)
