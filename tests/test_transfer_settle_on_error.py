"""The UCX receive side's exception ladder (:class:`~splitserve.transfer.ucx_requests.SettleOnError`), shared by the
KV fetch and the KV push: which failures settle the posted requests with the grace, which at once, and which
typed error comes out. No UCX needed: ``Posted.settle`` is faked."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.errors import KVChecksumMismatch, KVLayoutMismatch, KVTransferError, TransferNotFound
from splitserve.transfer.ucx_requests import SettleOnError
from splitserve.transfer.wire import WireError


class _Posted:
    def __init__(self) -> None:
        self.settled: list[float] = []

    async def settle(self, grace_s, abort) -> bool:
        self.settled.append(grace_s)
        abort()
        return False


async def _run(exc: BaseException | None):
    posted, aborts = _Posted(), []
    ctx = SettleOnError(posted, lambda: 0.25, lambda: aborts.append(1), what="KV fetch of 't' from k",
                        bad_answer="bad answer from KV sender k")
    try:
        async with ctx as p:
            assert p is posted
            if exc is not None:
                raise exc
        return None, posted.settled, aborts
    except BaseException as out:  # the ladder's result is what is checked
        return out, posted.settled, aborts


@pytest.mark.parametrize("exc", [KVTransferError("x"), KVChecksumMismatch("c"), TransferNotFound("n"), KVLayoutMismatch("l")])
async def test_the_blocks_own_verdicts_pass_through_after_a_graceful_settle(exc):
    out, settled, aborts = await _run(exc)
    assert out is exc and settled == [0.25] and aborts == [1]


async def test_cancel_settles_with_the_grace_and_stays_a_cancel():
    out, settled, _ = await _run(asyncio.CancelledError())
    assert isinstance(out, asyncio.CancelledError) and settled == [0.25]


async def test_timeout_and_bad_answer_settle_at_once_as_transfer_errors():
    out, settled, _ = await _run(asyncio.TimeoutError())
    assert type(out) is KVTransferError and str(out) == "KV fetch of 't' from k timed out" and settled == [0.0]
    assert out.__cause__ is None and out.__suppress_context__
    out, settled, _ = await _run(WireError("short"))
    assert type(out) is KVTransferError and str(out) == "bad answer from KV sender k: short" and settled == [0.0]


async def test_any_other_error_becomes_a_transfer_error_caused_by_it():
    boom = RuntimeError("endpoint closed")
    out, settled, _ = await _run(boom)
    assert type(out) is KVTransferError and out.__cause__ is boom and settled == [0.25]
    assert str(out) == f"KV fetch of 't' from k failed: {boom!r}"


async def test_success_settles_nothing():
    out, settled, aborts = await _run(None)
    assert out is None and settled == [] and aborts == []
