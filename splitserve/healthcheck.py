"""Container health check: ``python -m splitserve.healthcheck TARGET``.

TARGET is ``grpc:host:port`` (the standard gRPC health service, overall status) or an HTTP URL such as
``http://127.0.0.1:8000/health``. Exit status 0 when SERVING / HTTP 200, 1 otherwise, 2 for bad usage (Docker's
HEALTHCHECK contract). Each check gives up after ``TIMEOUT_S``. Imports only grpc and the standard library (no
torch: it runs every few seconds in every container).
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 2.0


def healthy(target: str, timeout_s: float = TIMEOUT_S) -> bool:
    """True if ``target`` (``grpc:host:port`` or an HTTP URL) reports healthy within ``timeout_s`` seconds."""
    if target.startswith("http"):
        try:
            with urllib.request.urlopen(target, timeout=timeout_s) as resp:  # noqa: S310 (http only, by the caller)
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    try:
        with grpc.insecure_channel(target.removeprefix("grpc:")) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (argv[0].startswith("grpc:") or argv[0].startswith("http")):
        print("usage: python -m splitserve.healthcheck grpc:HOST:PORT | http://HOST:PORT/health", file=sys.stderr)
        return 2
    ok = healthy(argv[0])
    if not ok:
        print(f"not healthy: {argv[0]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
