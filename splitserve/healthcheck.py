"""Container health check: ``python -m splitserve.healthcheck TARGET``.

TARGET is ``grpc:host:port`` (the standard gRPC health service, overall status) or an HTTP URL such as
``http://127.0.0.1:8000/health``. Exit status 0 when SERVING / HTTP 200, 1 otherwise, 2 for bad usage (Docker's
HEALTHCHECK contract). Each check gives up after ``TIMEOUT_S``. gRPC checks use the container's ``PD_TLS_*``
configuration (TLS, and the container's certificate for mutual TLS), like the server they check. Imports only grpc
and the standard library (no torch: it runs every few seconds in every container).
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 2.0


def healthy(target: str, timeout_s: float = TIMEOUT_S, tls=None) -> bool:
    """True if ``target`` (``grpc:host:port`` or an HTTP URL) reports healthy within ``timeout_s`` seconds.
    ``tls`` (a ``splitserve.rpc.tls.TlsConfig``): for gRPC targets, TLS when enabled (default: plaintext)."""
    if target.startswith("http"):
        try:
            with urllib.request.urlopen(target, timeout=timeout_s) as resp:  # http only, by the caller
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = target.removeprefix("grpc:")
    try:
        if tls is not None and tls.enabled:
            channel = grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
        else:
            channel = grpc.insecure_channel(address)
        with channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (argv[0].startswith("grpc:") or argv[0].startswith("http")):
        print("usage: python -m splitserve.healthcheck grpc:HOST:PORT | http://HOST:PORT/health", file=sys.stderr)
        return 2
    tls = None
    if argv[0].startswith("grpc:"):
        from splitserve.rpc.tls import tls_from_env  # grpc + standard library only

        try:
            tls = tls_from_env()
        except ValueError as exc:
            print(f"bad TLS configuration: {exc}", file=sys.stderr)
            return 2
    ok = healthy(argv[0], tls=tls)
    if not ok:
        print(f"not healthy: {argv[0]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
