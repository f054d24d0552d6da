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


class KVChecksumMismatch(KVTransferError):
    """The KV bytes that arrived do not match the checksum the sender computed (corrupted in transit)."""


class TransferNotFound(PdError):
    """The sender holds no KV for this transfer id: never registered, already sent, or lease expired (NOT_FOUND)."""


class CapacityExhausted(PdError):
    """No free KV blocks for the request (RESOURCE_EXHAUSTED)."""


class WorkerUnavailable(PdError):
    """No healthy worker could serve the request (UNAVAILABLE)."""


class DeadlineExceeded(PdError):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED, HTTP 504)."""
