"""The one place where splitserve errors become gRPC status codes (and back), and where KV store errors
become the per-key ``pd.v1.StoreStatus`` of batch calls (and back)."""

from __future__ import annotations

import grpc
from pd.v1 import kvstore_pb2 as kv

from splitserve import errors

_TO_CODE: list[tuple[type[Exception], grpc.StatusCode]] = [
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.KVLayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.TransferNotFound, grpc.StatusCode.NOT_FOUND),
    # KV store (before their multiple-inheritance bases CapacityExhausted / KVTransferError)
    (errors.ObjectNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ObjectNotReady, grpc.StatusCode.UNAVAILABLE),
    (errors.ObjectAlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.ObjectHasLease, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.LeaseExpired, grpc.StatusCode.ABORTED),
    (errors.StoreNoSpace, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NoStorageNode, grpc.StatusCode.UNAVAILABLE),
    (errors.WriteRevoked, grpc.StatusCode.ABORTED),
    (errors.StoreIOError, grpc.StatusCode.UNAVAILABLE),
    (errors.ChecksumMismatch, grpc.StatusCode.DATA_LOSS),
    (errors.CapacityExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.KVTransferError, grpc.StatusCode.UNAVAILABLE),
    (errors.WorkerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.RoleNotServed, grpc.StatusCode.ABORTED),  # retried on another worker; the worker stays in rotation
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
    """Abort the RPC with the status code for ``exc`` and its message (raises AbortError). A KV store error
    also names its ``StoreStatus`` in the trailing metadata (``pd-store-status``), so clients get the
    exact type back (:func:`store_error_from_rpc`)."""
    if isinstance(exc, errors.StoreError):
        context.set_trailing_metadata(((STORE_STATUS_KEY, str(store_status_for(exc))),))
    await context.abort(status_for(exc), str(exc) or type(exc).__name__)


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str) -> errors.PdError:
    """Typed error for a failed call to ``peer``; unknown codes become WorkerUnavailable."""
    cls = _FROM_CODE.get(exc.code(), errors.WorkerUnavailable)
    return cls(f"{peer}: {exc.code().name}: {exc.details()}")


# --- KV store per-key results (pd.v1.StoreStatus) -------------------------------------------------------

_STORE_ERRORS: dict[int, type[errors.StoreError]] = {
    kv.STORE_STATUS_NOT_FOUND: errors.ObjectNotFound,
    kv.STORE_STATUS_NOT_READY: errors.ObjectNotReady,
    kv.STORE_STATUS_ALREADY_EXISTS: errors.ObjectAlreadyExists,
    kv.STORE_STATUS_NO_SPACE: errors.StoreNoSpace,
    kv.STORE_STATUS_HAS_LEASE: errors.ObjectHasLease,
    kv.STORE_STATUS_LEASE_EXPIRED: errors.LeaseExpired,
    kv.STORE_STATUS_NO_SEGMENT: errors.NoStorageNode,
    kv.STORE_STATUS_WRITE_REVOKED: errors.WriteRevoked,
}


STORE_STATUS_KEY = "pd-store-status"


def store_error_from_rpc(exc: grpc.aio.AioRpcError, peer: str) -> errors.PdError:
    """Like :func:`error_from_rpc`, but a KV store error comes back as its exact type."""
    for key, value in exc.trailing_metadata() or ():
        if key == STORE_STATUS_KEY and value.isdigit():
            err = store_error(int(value), f"{peer}: {exc.details()}")
            if err is not None:
                return err
    return error_from_rpc(exc, peer)


def store_status_for(exc: BaseException) -> int:
    """The ``StoreStatus`` of a KV store error (INVALID for InvalidRequest and anything unknown)."""
    for number, cls in _STORE_ERRORS.items():
        if type(exc) is cls:
            return number
    return kv.STORE_STATUS_INVALID


def store_error(status: int, detail: str = "") -> errors.PdError | None:
    """The typed error of a per-key ``StoreStatus`` (None for OK)."""
    if status == kv.STORE_STATUS_OK:
        return None
    cls = _STORE_ERRORS.get(status)
    if cls is None:
        return errors.InvalidRequest(detail or f"store status {kv.StoreStatus.Name(status) if status in kv.StoreStatus.values() else status}")
    return cls(detail or cls.__name__)
