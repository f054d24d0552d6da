"""Router settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from splitserve.paths import default_model_path


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str
    prefill: tuple[str, ...]  # prefill worker gRPC addresses host:port
    decode: tuple[str, ...]  # decode worker gRPC addresses host:port
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    served_model_name: str | None = None
    prefill_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode worker address")


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


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
    a = ap.parse_args(argv)
    return RouterConfig(
        model=a.model, prefill=a.prefill, decode=a.decode, host=a.host, http_port=a.http_port,
        grpc_port=a.grpc_port, served_model_name=a.served_model_name, prefill_timeout_s=a.prefill_timeout_s,
    )
