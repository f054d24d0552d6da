"""The one place where exceptions become HTTP statuses and OpenAI error bodies.

OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``.

Mapping:
    APIError                      -> its own status (400 validation, 404 model_not_found, ...)
    starlette HTTPException       -> its status (unknown route 404, wrong method 405)
    splitserve.errors.InvalidRequest -> 400 invalid_request_error
    CapacityExhausted             -> 503 server_error / capacity_exhausted (+ Retry-After)
    WorkerUnavailable             -> 503 server_error / worker_unavailable
    KVTransferError               -> 503 server_error / kv_transfer_failed
    TransferNotFound              -> 503 server_error / kv_transfer_not_found
    KVLayoutMismatch              -> 500 server_error / kv_layout_mismatch
    DeadlineExceeded              -> 504 server_error / deadline_exceeded
    any other exception           -> 500 server_error / internal_error (message not leaked)

503 is used for capacity problems (not 429): they are server-wide and transient, not a
per-client rate limit. OpenAI SDK clients retry both.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from splitserve import errors as pd

log = logging.getLogger(__name__)

_RETRY_AFTER_S = "1"


class APIError(Exception):
    """An error with a known HTTP status and OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object ``{"error": {...}}`` (text that echoes client input made UTF-8 safe)."""
        return {"error": {"message": utf8_safe(self.message), "type": self.type,
                          "param": None if self.param is None else utf8_safe(self.param), "code": self.code}}


def utf8_safe(text: str) -> str:
    """``text`` with unpaired surrogates (from client JSON escapes) written as ``\\udXXX`` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def model_not_found(model: str) -> APIError:
    """404 for a request naming a model this server does not serve."""
    return APIError(
        f"The model `{model}` does not exist or you do not have access to it.",
        status=404,
        param="model",
        code="model_not_found",
    )


_PD_ERRORS: list[tuple[type[Exception], int, str, str | None]] = [
    (pd.InvalidRequest, 400, "invalid_request_error", None),
    (pd.CapacityExhausted, 503, "server_error", "capacity_exhausted"),
    (pd.WorkerUnavailable, 503, "server_error", "worker_unavailable"),
    (pd.KVTransferError, 503, "server_error", "kv_transfer_failed"),
    (pd.TransferNotFound, 503, "server_error", "kv_transfer_not_found"),
    (pd.KVLayoutMismatch, 500, "server_error", "kv_layout_mismatch"),
    (pd.DeadlineExceeded, 504, "server_error", "deadline_exceeded"),
]


def to_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """Classify any exception as an :class:`APIError` (logging server-side ones)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, HTTPException):
        typ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(str(exc.detail or "error"), status=exc.status_code, type=typ)
    for cls, status, typ, code in _PD_ERRORS:
        if isinstance(exc, cls):
            if status >= 500:
                log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
            return APIError(str(exc) or cls.__name__, status=status, type=typ, code=code)
    log.error("request %s: unexpected error", request_id, exc_info=exc)
    return APIError("Internal server error", status=500, type="server_error", code="internal_error")


def error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """A JSON response with the right status, headers and OpenAI error body for ``exc``."""
    err = to_api_error(exc, request_id)
    headers = dict(getattr(exc, "headers", None) or {})
    if err.status == 503:
        headers.setdefault("Retry-After", _RETRY_AFTER_S)
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)
