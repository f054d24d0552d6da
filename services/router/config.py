"""Router settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from splitserve.paths import default_model_path
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str
    prefill: tuple[str, ...]  # prefill worker gRPC addresses host:port
    decode: tuple[str, ...]  # decode worker gRPC addresses host:port
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    served_model_name: str | None = None
    prefill_timeout_s: float = 60.0  # liveness guard of one prefill call (a hung worker is retried elsewhere)
    prefill_attempts: int = 2  # distinct prefill workers tried per request
    decode_attempts: int = 2  # distinct decode workers tried while no decode token has arrived
    local_prefill_fallback: bool = True  # all prefill attempts failed: the decode worker prefills
    request_timeout_s: float | None = None  # deadline of each HTTP request; None = none (gRPC: the caller's)
    api_key: str | None = None  # Bearer key for the HTTP API and RouterService; None = open
    tls: TlsConfig = TlsConfig()

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode worker address")
        if self.prefill_timeout_s <= 0:
            raise ValueError(f"prefill_timeout_s must be > 0, got {self.prefill_timeout_s}")
        if self.prefill_attempts < 1 or self.decode_attempts < 1:
            raise ValueError("prefill_attempts and decode_attempts must be >= 1")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def _optional_float(value: str | None) -> float | None:
    return float(value) if value not in (None, "", "0", "0.0", "none") else None


def parse(argv: list[str] | None = None) -> RouterConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="splitserve router", description="Run the router (OpenAI HTTP + gRPC front door).")
    ap.add_argument("--model", default=env("PD_MODEL", str(default_model_path())), help="model folder/file (tokenizer, chat template)")
    ap.add_argument("--served-model-name", default=env("PD_SERVED_MODEL_NAME"))
    ap.add_argument("--prefill", type=_addresses, default=_addresses(env("PD_PREFILL_ADDRS", "127.0.0.1:50061")), help="comma-separated host:port")
    ap.add_argument("--decode", type=_addresses, default=_addresses(env("PD_DECODE_ADDRS", "127.0.0.1:50071")), help="comma-separated host:port")
    ap.add_argument("--host", default=env("PD_HOST", "127.0.0.1"))
    ap.add_argument("--http-port", type=int, default=int(env("PD_HTTP_PORT", "8000")))
    ap.add_argument("--grpc-port", type=int, default=int(env("PD_GRPC_PORT", "50050")))
    ap.add_argument("--prefill-timeout-s", type=float, default=float(env("PD_PREFILL_TIMEOUT_S", "60")))
    ap.add_argument("--prefill-attempts", type=int, default=int(env("PD_PREFILL_ATTEMPTS", "2")))
    ap.add_argument("--decode-attempts", type=int, default=int(env("PD_DECODE_ATTEMPTS", "2")))
    ap.add_argument("--local-prefill-fallback", action=argparse.BooleanOptionalAction,
                    default=env("PD_LOCAL_PREFILL_FALLBACK", "1").lower() in ("1", "true", "yes", "on"),
                    help="when no prefill worker succeeds, let the decode worker prefill")
    ap.add_argument("--request-timeout-s", type=_optional_float, default=_optional_float(env("PD_REQUEST_TIMEOUT_S")),
                    help="deadline of each HTTP request (0 or unset: none)")
    ap.add_argument("--api-key", default=env("PD_API_KEY") or None,
                    help="require Authorization: Bearer <key> on the HTTP API and RouterService (prefer PD_API_KEY)")
    add_tls_args(ap)
    a = ap.parse_args(argv)
    return RouterConfig(
        model=a.model, prefill=a.prefill, decode=a.decode, host=a.host, http_port=a.http_port,
        grpc_port=a.grpc_port, served_model_name=a.served_model_name, prefill_timeout_s=a.prefill_timeout_s,
        prefill_attempts=a.prefill_attempts, decode_attempts=a.decode_attempts,
        local_prefill_fallback=a.local_prefill_fallback, request_timeout_s=a.request_timeout_s,
        api_key=a.api_key, tls=tls_config(a),
    )
