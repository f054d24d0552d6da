"""The one place where splitserve errors become gRPC status codes (and back)."""

from __future__ import annotations

import grpc

from splitserve import errors

_TO_CODE: list[tuple[type[Exception], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.KVLayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.TransferNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.CapacityExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.KVTransferError, grpc.StatusCode.UNAVAILABLE),
    (errors.WorkerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
]

_FROM_CODE: dict[grpc.StatusCode, type[errors.PdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: errors.KVLayoutMismatch,
    grpc.StatusCode.NOT_FOUND: errors.TransferNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _TO_CODE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status code for ``exc`` and its message (raises AbortError)."""
    await context.abort(status_for(exc), str(exc) or type(exc).__name__)


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str) -> errors.PdError:
    """Typed error for a failed call to ``peer``; unknown codes become WorkerUnavailable."""
    cls = _FROM_CODE.get(exc.code(), errors.WorkerUnavailable)
    return cls(f"{peer}: {exc.code().name}: {exc.details()}")
