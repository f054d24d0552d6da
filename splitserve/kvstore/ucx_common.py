"""Small UCX (ucxx) helpers shared by the store's client and storage node.

UCX set-up rules (init inside the running loop, progress thread, ``UCX_MM_ERROR_HANDLING=y``, stop the
notifier thread before exit) live in :mod:`splitserve.transfer.ucx_runtime`; call its ``acquire`` on
start and ``release`` on close.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("splitserve.kvstore.ucx")


def ucxx():
    import ucxx as _ucxx  # noqa: PLC0415 - lazy: importing ucxx touches os.environ and loads UCX

    return _ucxx


def abort_endpoint(ep) -> None:
    """Close ``ep`` now: cancels every request posted on it; returns once UCX finished cancelling."""
    try:
        ep.abort(period=2 * 10**9, max_attempts=1)
    except Exception:  # pragma: no cover - defensive
        logger.exception("aborting UCX endpoint failed")


def consume(tasks) -> None:
    """Retrieve results of finished tasks so asyncio does not log 'exception was never retrieved'."""
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
