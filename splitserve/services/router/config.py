"""Router settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from splitserve.cli_help import SECRET_DEFAULT, new_parser
from splitserve.env import EnvError, env_bool, env_choice, env_float, env_int, env_str
from splitserve.kvstore.config import TRANSFER_MODES
from splitserve.config_checks import check_port
from splitserve.paths import default_model_path
from splitserve.rpc.keepalive import KeepaliveConfig, add_keepalive_args, keepalive_config
from splitserve.rpc.shutdown import DEFAULT_GRACE_S, add_shutdown_args, check_grace
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config
from splitserve.frontend.continuity_args import add_continuity_args, check_continuity_mb
from splitserve.frontend.http_limits import HttpLimits
from splitserve.services.router.planner import PlannerConfig, add_planner_args, planner_config


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str
    prefill: tuple[str, ...]  # prefill worker gRPC addresses host:port
    decode: tuple[str, ...]  # decode worker gRPC addresses host:port
    workers: tuple[str, ...] = ()  # addresses of workers whose role can change (`splitserve worker`), host:port
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    served_model_name: str | None = None
    prefill_timeout_s: float = 60.0  # liveness guard of one prefill call (a hung worker is retried elsewhere)
    policy: str = "round_robin"  # round_robin | least_loaded | prefix_aware
    disagg: str = "always"  # always | auto | <uncached-token threshold>
    disagg_max_stall_ms: float = 200.0  # auto: the longest a local prefill may stall the decode worker's streams; 0: no cap
    # prefix_aware: skip the prefill worker when the decode worker holds all but at most this many prompt tokens; 0: never
    skip_prefill_tokens: int = 32
    poll_interval_s: float = 1.0  # worker heartbeat (health + stats poll) period
    miss_limit: int = 2  # missed heartbeats before a worker leaves rotation
    prefill_attempts: int = 2  # distinct prefill workers tried before local prefill on the decode worker
    decode_attempts: int = 2  # distinct decode workers tried before the stream starts
    decode_migrations: int = 1  # moves of a choice's stream to another decode worker after a mid-stream failure; 0 = off
    local_prefill_fallback: bool = True  # all prefill attempts failed: the decode worker prefills
    request_timeout_s: float | None = None  # deadline of each HTTP request; None = none (gRPC: the caller's)
    api_key: str | None = None  # Bearer key for the HTTP API and RouterService; None = open
    tls: TlsConfig = TlsConfig()
    decode_stall_timeout_s: float | None = 60.0  # a decode stream silent this long is ended as a failed worker; None = off
    keepalive: KeepaliveConfig = KeepaliveConfig()  # gRPC PINGs: hung workers detected
    shutdown_grace_s: float = DEFAULT_GRACE_S  # SIGTERM: in-flight requests may finish within this (0: stop at once)
    http: HttpLimits = HttpLimits()  # read deadlines and connection cap of the HTTP listener (PD_HTTP_*)
    planner: PlannerConfig | None = None  # --planner: flips --workers between prefill and decode; None = off
    kv_transfer_mode: str = "direct"  # "push": prefill and decode dispatched at once (push_leg); direct/store: pull
    chat_token_continuity: bool = True  # prompts continuing an earlier prompt + completion reuse its token ids
    chat_token_continuity_mb: int = 64  # memory of the remembered texts and token ids, MiB

    def __post_init__(self) -> None:
        check_grace(self.shutdown_grace_s)
        if self.decode_stall_timeout_s is not None and not self.decode_stall_timeout_s > 0:
            raise ValueError(f"decode_stall_timeout_s must be > 0 (None: off), got {self.decode_stall_timeout_s}")
        if not (self.prefill or self.workers) or not (self.decode or self.workers):
            raise ValueError("the router needs at least one --prefill and one --decode worker address (or --workers)")
        check_port("--http-port", self.http_port)
        check_port("--grpc-port", self.grpc_port)
        if self.http_port and self.http_port == self.grpc_port:
            raise ValueError(f"--http-port and --grpc-port must differ, both are {self.http_port}")
        from splitserve.services.router.policies import POLICIES

        if self.prefill_timeout_s <= 0:
            raise ValueError(f"prefill_timeout_s must be > 0, got {self.prefill_timeout_s}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.disagg not in ("always", "auto") and not self.disagg.isdigit():
            raise ValueError(f"--disagg must be 'always', 'auto' or a token count, got {self.disagg!r}")
        if not self.disagg_max_stall_ms >= 0:
            raise ValueError(f"--disagg-max-stall-ms must be >= 0 (0: no cap), got {self.disagg_max_stall_ms}")
        if self.skip_prefill_tokens < 0:
            raise ValueError(f"--skip-prefill-tokens must be >= 0 (0: never skip), got {self.skip_prefill_tokens}")
        if self.poll_interval_s <= 0 or self.miss_limit < 1 or self.prefill_attempts < 1 or self.decode_attempts < 1:
            raise ValueError("--poll-interval-s must be > 0; --miss-limit and the attempt counts >= 1")
        if self.decode_migrations < 0:
            raise ValueError(f"--decode-migrations must be >= 0 (0: off), got {self.decode_migrations}")
        if self.kv_transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"--kv-transfer-mode must be one of {', '.join(TRANSFER_MODES)}, got {self.kv_transfer_mode!r}")
        check_continuity_mb(self.chat_token_continuity_mb)
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def _optional_float(value: str | None) -> float | None:
    return float(value) if value not in (None, "", "0", "0.0", "none") else None


def _optional_float_env(name: str, default: str | None) -> float | None:
    """``name`` (or ``default``) as :func:`_optional_float` reads it; raises EnvError on a non-number."""
    value = env_str(name, default)
    try:
        return _optional_float(value)
    except ValueError:
        raise EnvError(name, value, "a number of seconds (0 or none: off)") from None


def _given(argv: list[str] | None, flag: str, env: str) -> bool:
    """Whether ``flag`` is on the command line (``argv``, or sys.argv when None) or ``env`` is set."""
    args = sys.argv[1:] if argv is None else argv
    return env_str(env) is not None or any(a == flag or a.startswith(flag + "=") for a in args)


def parse(argv: list[str] | None = None) -> RouterConfig:
    ap = new_parser("splitserve router", "Run the router (OpenAI HTTP + gRPC front door).")
    ap.add_argument("--model", default=env_str("PD_MODEL", str(default_model_path())), help="model folder/file (tokenizer, chat template)")
    ap.add_argument("--served-model-name", default=env_str("PD_SERVED_MODEL_NAME"),
                    help="model name the API answers to (default: the model folder's or file's name)")
    ap.add_argument("--prefill", type=_addresses, default=env_str("PD_PREFILL_ADDRS", "127.0.0.1:50061"),
                    help="prefill workers' gRPC addresses, comma-separated host:port (with --workers: none unless given)")
    ap.add_argument("--decode", type=_addresses, default=env_str("PD_DECODE_ADDRS", "127.0.0.1:50071"),
                    help="decode workers' gRPC addresses, comma-separated host:port (with --workers: none unless given)")
    ap.add_argument("--workers", type=_addresses, default=env_str("PD_WORKER_ADDRS", ""),
                    help="gRPC addresses of workers whose role can change (`splitserve worker`), comma-separated host:port; "
                         "the router follows the role each one announces")
    ap.add_argument("--host", default=env_str("PD_HOST", "127.0.0.1"), help="address the HTTP and gRPC servers listen on")
    ap.add_argument("--http-port", type=int, default=env_int("PD_HTTP_PORT", 8000), help="OpenAI HTTP API port (0: any free port)")
    ap.add_argument("--grpc-port", type=int, default=env_int("PD_GRPC_PORT", 50050),
                    help="gRPC port of pd.v1.RouterService (0: any free port)")
    ap.add_argument("--prefill-timeout-s", type=float, default=env_float("PD_PREFILL_TIMEOUT_S", 60.0),
                    help="seconds one prefill call may take before it is retried on another worker")
    ap.add_argument("--policy", default=env_str("PD_ROUTING_POLICY", "round_robin"), help="round_robin | least_loaded | prefix_aware")
    ap.add_argument("--disagg", default=env_str("PD_DISAGG", "always"),
                    help="always (remote prefill), auto (measured cost model), or N: prefill prompts with < N uncached tokens on the decode worker")
    ap.add_argument("--disagg-max-stall-ms", type=float, default=env_float("PD_DISAGG_MAX_STALL_MS", 200.0),
                    help="with --disagg auto: prefill on the decode worker only prompts whose prefill (at its measured "
                         "speed) stalls its running streams for at most this long (0: no cap)")
    ap.add_argument("--skip-prefill-tokens", type=int, default=env_int("PD_SKIP_PREFILL_TOKENS", 32),
                    help="with --policy prefix_aware: prefill on the decode worker (its prefix cache) when it is believed to "
                         "hold all but at most this many prompt tokens (0: never; 1: all but the last token)")
    ap.add_argument("--poll-interval-s", type=float, default=env_float("PD_POLL_INTERVAL_S", 1.0), help="worker heartbeat period")
    ap.add_argument("--miss-limit", type=int, default=env_int("PD_MISS_LIMIT", 2), help="missed heartbeats before a worker is marked down")
    ap.add_argument("--prefill-attempts", type=int, default=env_int("PD_PREFILL_ATTEMPTS", 2),
                    help="distinct prefill workers tried per request before the fallback")
    ap.add_argument("--decode-attempts", type=int, default=env_int("PD_DECODE_ATTEMPTS", 2),
                    help="distinct decode workers tried per request before its stream starts")
    ap.add_argument("--decode-migrations", type=int, default=env_int("PD_DECODE_MIGRATIONS", 1),
                    help="times a stream may move to another decode worker when its worker dies or stalls mid-stream, "
                         "continuing token-exact from the tokens already sent (0: off, the stream ends with an error)")
    ap.add_argument("--local-prefill-fallback", action=argparse.BooleanOptionalAction,
                    default=env_bool("PD_LOCAL_PREFILL_FALLBACK", True),
                    help="when no prefill worker succeeds, let the decode worker prefill")
    ap.add_argument("--request-timeout-s", type=_optional_float, default=_optional_float_env("PD_REQUEST_TIMEOUT_S", None),
                    help="deadline of each HTTP request (0 or unset: none)")
    ap.add_argument("--api-key", default=env_str("PD_API_KEY"),
                    help=f"require Authorization: Bearer <key> on the HTTP API and RouterService; prefer PD_API_KEY {SECRET_DEFAULT}")
    ap.add_argument("--decode-stall-timeout-s", type=_optional_float, default=_optional_float_env("PD_DECODE_STALL_TIMEOUT_S", "60"),
                    help="a decode stream with no message for this long fails (failover before its first token); 0: off")
    ap.add_argument("--kv-transfer-mode", default=env_choice("PD_KV_TRANSFER_MODE", TRANSFER_MODES, "direct"), choices=TRANSFER_MODES,
                    help="push: dispatch prefill and decode at once, the prefill worker writes the KV into the decode "
                         "worker's blocks layer by layer; direct/store: the decode worker reads it after the prefill")
    add_continuity_args(ap)
    add_tls_args(ap)
    add_keepalive_args(ap)
    add_shutdown_args(ap)
    add_planner_args(ap)
    a = ap.parse_args(argv)
    workers = _addresses(a.workers) if isinstance(a.workers, str) else a.workers
    if workers:  # the default addresses of born-to-one-role workers apply only without --workers
        prefill = _addresses(a.prefill) if isinstance(a.prefill, str) else a.prefill
        decode = _addresses(a.decode) if isinstance(a.decode, str) else a.decode
        a.prefill = () if prefill == ("127.0.0.1:50061",) and not _given(argv, "--prefill", "PD_PREFILL_ADDRS") else prefill
        a.decode = () if decode == ("127.0.0.1:50071",) and not _given(argv, "--decode", "PD_DECODE_ADDRS") else decode
    return RouterConfig(
        model=a.model, prefill=a.prefill, decode=a.decode, workers=workers, host=a.host, http_port=a.http_port,
        grpc_port=a.grpc_port, served_model_name=a.served_model_name, prefill_timeout_s=a.prefill_timeout_s,
        policy=a.policy, disagg=a.disagg.strip().lower(), disagg_max_stall_ms=a.disagg_max_stall_ms, skip_prefill_tokens=a.skip_prefill_tokens,
        poll_interval_s=a.poll_interval_s, miss_limit=a.miss_limit,
        prefill_attempts=a.prefill_attempts, decode_attempts=a.decode_attempts, decode_migrations=a.decode_migrations,
        local_prefill_fallback=a.local_prefill_fallback, request_timeout_s=a.request_timeout_s,
        api_key=a.api_key, tls=tls_config(a), decode_stall_timeout_s=a.decode_stall_timeout_s,
        keepalive=keepalive_config(a), shutdown_grace_s=a.shutdown_grace_s, http=HttpLimits.from_env(),
        planner=planner_config(a),
        kv_transfer_mode=a.kv_transfer_mode, chat_token_continuity=a.chat_token_continuity,
        chat_token_continuity_mb=a.chat_token_continuity_mb,
    )
