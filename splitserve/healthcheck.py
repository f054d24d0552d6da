"""Container health check: ``python -m splitserve.healthcheck TARGET``.

TARGET is ``grpc:host:port`` (the standard gRPC health service, overall status) or an HTTP URL such as
``http://127.0.0.1:8000/health``. Exit status 0 when SERVING / HTTP 200, 1 otherwise (Docker's
HEALTHCHECK contract). Each check gives up after one second.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (argv[0].startswith("grpc:") or argv[0].startswith("http")):
        print("usage: python -m splitserve.healthcheck grpc:HOST:PORT | http://HOST:PORT/health", file=sys.stderr)
        return 2
    from splitserve.launcher import _healthy  # noqa: PLC0415

    ok = _healthy(argv[0])
    if not ok:
        print(f"not healthy: {argv[0]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
