"""Server interceptors shared by every service.

* :class:`StrictDecodeInterceptor`: a pd.v1 request that is not a valid protobuf message is refused with
  INVALID_ARGUMENT (grpcio would answer UNKNOWN), before the servicer runs.
* :class:`ApiKeyInterceptor`: methods of the protected services require ``authorization: Bearer <key>``
  metadata; anything else is UNAUTHENTICATED. The key is compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable, Sequence

import grpc
from google.protobuf.message import DecodeError

_PD_PREFIX = "/pd.v1."


def _decoder(deserialize: Callable[[bytes], Any] | None):
    async def decode(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except (DecodeError, ValueError, TypeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")

    return decode


def _with_raw_requests(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with request parsing moved into the behaviour (so a parse error gets our status)."""
    decode = _decoder(handler.request_deserializer)
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(raw, context):
            return await inner_uu(await decode(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(raw, context):
            async for response in inner_us(await decode(raw, context), context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=handler.response_serializer)
    return handler  # client-streaming methods: none in pd.v1


class StrictDecodeInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_PD_PREFIX):
            return handler
        return _with_raw_requests(handler)


def _deny(code: grpc.StatusCode, message: str, streaming: bool) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <api_key>`` on every method of ``services`` (full names)."""

    def __init__(self, api_key: str, services: Sequence[str]) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._expected = f"Bearer {api_key}".encode()
        self._prefixes = tuple(f"/{s}/" for s in services)

    def authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefixes) or self.authorized(details.invocation_metadata):
            return handler
        return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer <key>)",
                     handler.unary_stream is not None)
