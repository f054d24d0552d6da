"""Typed errors shared by every service; mapped to gRPC status codes in one place (grpc_status)."""

from __future__ import annotations


class PdError(Exception):
    """Base of all splitserve errors."""


class InvalidRequest(PdError):
    """The request is malformed or out of range (HTTP 400, INVALID_ARGUMENT)."""


class KVLayoutMismatch(PdError):
    """Prefill and decode KV layouts differ (FAILED_PRECONDITION)."""


class KVTransferError(PdError):
    """Moving KV bytes between workers failed or timed out (UNAVAILABLE)."""


class KVTransferCancelled(KVTransferError):
    """The other side's request was cancelled by its caller (a client that went away): a normal end, not a fault."""


class KVChecksumMismatch(KVTransferError):
    """The KV bytes that arrived do not match the checksum the sender computed (corrupted in transit)."""


class TransferNotFound(PdError):
    """The sender holds no KV for this transfer id: never registered, already sent, or lease expired (NOT_FOUND)."""


class CapacityExhausted(PdError):
    """No free KV blocks for the request (RESOURCE_EXHAUSTED)."""


class WorkerUnavailable(PdError):
    """No healthy worker could serve the request (UNAVAILABLE)."""


class StreamStalled(WorkerUnavailable):
    """A worker's stream sent nothing for longer than its stall timeout: treated as a failed worker (UNAVAILABLE)."""


class RoleNotServed(PdError):
    """The worker does not take this kind of work in its current role (it switched): try another worker (ABORTED)."""


class DeadlineExceeded(PdError):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED, HTTP 504)."""
# --- KV store (splitserve/services/kvstore, splitserve/kvstore) ---------------------------------------------------


class StoreError(PdError):
    """A KV store call failed for one object (typed; absence is never signalled by empty bytes)."""


class ObjectNotFound(StoreError):
    """No such object: never written, removed, evicted, reclaimed or lost with its last replica (NOT_FOUND)."""


class ObjectNotReady(StoreError):
    """The object is being written (PutStart without PutEnd); readers must not use it (UNAVAILABLE)."""


class ObjectAlreadyExists(StoreError):
    """PutStart of a key that is complete or being written by another writer (ALREADY_EXISTS)."""


class ObjectHasLease(StoreError):
    """Remove of an object under a read lease (FAILED_PRECONDITION)."""


class LeaseExpired(StoreError):
    """A read finished after its read lease ended: the bytes may have been replaced; recompute (ABORTED)."""


class StoreNoSpace(StoreError, CapacityExhausted):
    """No storage segment can hold the object, even after eviction (RESOURCE_EXHAUSTED)."""


class NoStorageNode(StoreError):
    """No live storage node is mounted (UNAVAILABLE)."""


class WriteRevoked(StoreError):
    """PutEnd/PutRevoke of a write that was reclaimed (timeout) or replaced (ABORTED)."""


class StoreIOError(StoreError, KVTransferError):
    """Moving object bytes to or from a storage node failed, timed out or was refused (UNAVAILABLE)."""


class ChecksumMismatch(StoreError):
    """Bytes read do not match the checksum recorded at PutEnd (DATA_LOSS)."""
