"""`splitserve up` settings: :class:`UpConfig` (one frozen dataclass, validated in ``__post_init__``) and
:func:`parse`, which builds it from CLI flags with PD_* environment defaults.

The launcher (:func:`splitserve.launcher.up_cluster`) turns it into processes; each process's own settings are
checked by that process's config afterwards (``splitserve up`` does it before starting any).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from splitserve.dtypes import DTYPE_CHOICES, check_dtype_choice
from splitserve.engine.device import DEVICE_HELP, check_device
from splitserve.cli_help import SECRET_DEFAULT, new_parser
from splitserve.config_checks import check_push_layer_groups
from splitserve.cpus import check_cpus
from splitserve.env import env_bool, env_choice, env_float, env_int, env_str
from splitserve.frontend.continuity_args import add_continuity_args, check_continuity_mb
from splitserve.paths import default_model_path
from splitserve.rpc.shutdown import DEFAULT_GRACE_S
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config

TRANSPORTS = ("ucx",)
TRANSFER_MODES = ("direct", "store", "push")
POLICIES = ("round_robin", "least_loaded", "prefix_aware")
DEFAULT_OTLP_ENDPOINT = "http://127.0.0.1:4317"


@dataclass(frozen=True, slots=True)
class UpConfig:
    """Attributes:

    model: HF folder, ``.gguf`` file or ``synthetic:<name>``, for every process.
    num_prefill, num_decode: worker processes of each role (>= 1).
    elastic: every worker is a `splitserve worker` whose role can change in place (started as prefill or decode as
        ``num_prefill``/``num_decode`` say); the router gets them as ``--workers``.
    planner: the router flips those workers between prefill and decode as the load asks (needs ``elastic``), against
        the SLO targets ``slo_ttft_ms`` / ``slo_itl_ms`` (ms of the p90; None: not a signal).
    host: address every process listens on. http_port, grpc_port: the router's (0: any free port).
    transport, block_size, kv_cache_mb, kv_transfer_mode, dtype, max_model_len: passed to every worker (block_size
        and max_model_len in tokens, kv_cache_mb in MiB; dtype "auto" = the checkpoint's, max_model_len 0 = the model's).
    kv_push_layer_groups: push mode, layer groups per push (0: one per layer; 1: the whole KV after the prefill);
        passed with ``kv_transfer_mode`` "push" to every decode worker (with ``elastic``, to every worker: any may
        become a decode worker).
    decode_migrations: the router's moves of a stream to another decode worker after a mid-stream failure (0: off).
    chat_token_continuity, chat_token_continuity_mb: the router's token continuity and its memory in MiB.
    store_nodes: KV store storage nodes (0: no store, no master). store_mb: segment per node, MiB.
    store_replicas: copies per object, on distinct nodes (<= store_nodes).
    policy, disagg: the router's worker selection and its disaggregation rule (checked by the router's config).
    served_model_name: the name the router answers to (None: the model folder's or file's name).
    api_key: the router's Bearer key for its HTTP API and RouterService (None: open); given to the router in its
        environment (PD_API_KEY), never on a command line.
    shutdown_grace_s: on Ctrl-C/SIGTERM, in-flight requests may finish within this many seconds.
    otlp_endpoint: where every process exports OpenTelemetry traces; None: tracing as the environment says.
    tls: one TLS configuration for every gRPC server and channel of the cluster (store included).

    Raises:
        ValueError: a value out of range or settings that contradict each other; the message names the flag.
    """

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    transport: str = "ucx"
    block_size: int = 16
    kv_cache_mb: int = 256
    kv_transfer_mode: str = "direct"
    dtype: str = "auto"
    max_model_len: int = 0
    store_nodes: int = 1
    store_mb: int = 256
    store_replicas: int = 1
    policy: str = "round_robin"
    disagg: str = "always"
    disagg_max_stall_ms: float = 200.0  # the router's --disagg-max-stall-ms (auto)
    shutdown_grace_s: float = DEFAULT_GRACE_S
    otlp_endpoint: str | None = None
    tls: TlsConfig = TlsConfig()
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    prefill_cpus: str = ""
    decode_cpus: str = ""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0  # 0: the engine's default for the chunking mode
    enable_chunked_prefill: bool = False
    elastic: bool = False
    planner: bool = False
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    kv_push_layer_groups: int = 0
    decode_migrations: int = 1
    chat_token_continuity: bool = True
    chat_token_continuity_mb: int = 64
    device: str = "cpu"  # every worker's --device (whether a GPU is there: each worker checks at start-up)
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"--prefill and --decode: need at least one prefill and one decode worker, "
                             f"got {self.num_prefill} and {self.num_decode}")
        if self.planner and not self.elastic:
            raise ValueError("--planner flips workers whose role can change: add --elastic")
        for flag, slo in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-itl-ms", self.slo_itl_ms)):
            if slo is not None and not slo > 0:
                raise ValueError(f"{flag} must be > 0, got {slo}")
        if not self.disagg_max_stall_ms >= 0:
            raise ValueError(f"--disagg-max-stall-ms must be >= 0 (0: no cap), got {self.disagg_max_stall_ms}")
        if self.kv_push_layer_groups < 0:
            raise ValueError(f"--kv-push-layer-groups must be >= 0 (0: one per layer), got {self.kv_push_layer_groups}")
        if self.decode_migrations < 0:
            raise ValueError(f"--decode-migrations must be >= 0 (0: off), got {self.decode_migrations}")
        check_continuity_mb(self.chat_token_continuity_mb)
        if self.store_nodes < 0:
            raise ValueError(f"--store-nodes must be >= 0, got {self.store_nodes}")
        if self.kv_transfer_mode == "store" and not self.store_nodes:
            raise ValueError("--kv-transfer-mode store needs the KV store (drop --no-store, --store-nodes >= 1)")
        if self.store_nodes and self.store_replicas > self.store_nodes:
            raise ValueError(f"--store-replicas {self.store_replicas} needs at least as many storage nodes "
                             f"(--store-nodes {self.store_nodes})")
        if self.http_port and self.http_port == self.grpc_port:
            raise ValueError(f"--http-port and --grpc-port must differ, both are {self.http_port}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        check_dtype_choice(self.dtype)
        check_device(self.device)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 0:
            raise ValueError(f"--max-num-seqs must be >= 1 and --max-num-batched-tokens >= 0 (0: the default), got "
                             f"{self.max_num_seqs} and {self.max_num_batched_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"--max-model-len must be >= 0 (0: the model's context length), got {self.max_model_len}")
        for flag, cpus in (("--prefill-cpus", self.prefill_cpus), ("--decode-cpus", self.decode_cpus)):
            if cpus:
                try:
                    check_cpus(cpus)
                except ValueError as exc:
                    raise ValueError(f"{flag}: {exc}") from None
        if self.tls.enabled and not self.tls.cert_file:
            raise ValueError("TLS: the cluster's gRPC servers need --tls-cert and --tls-key (PD_TLS_CERT, PD_TLS_KEY)")

    def worker_args(self) -> list[str]:
        """Flags every prefill and decode worker gets (every elastic worker: the decode workers' flags too)."""
        push = self.push_args() if self.elastic else []
        return [*push, "--transport", self.transport, "--block-size", str(self.block_size), "--kv-cache-mb",
                str(self.kv_cache_mb), "--kv-transfer-mode", self.kv_transfer_mode, "--dtype", self.dtype,
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                *(["--enable-chunked-prefill"] if self.enable_chunked_prefill else []),
                "--device", self.device, *(["--enforce-eager"] if self.enforce_eager else [])]

    def role_args(self) -> dict[str, list[str]]:
        """Flags only the workers of one role get: their CPU pinning (``--cpus``); decode workers: :meth:`push_args`
        (an elastic worker gets those from :meth:`worker_args`)."""
        args = {role: ["--cpus", cpus] for role, cpus in (("prefill", self.prefill_cpus), ("decode", self.decode_cpus)) if cpus}
        if not self.elastic and self.push_args():
            args.setdefault("decode", []).extend(self.push_args())
        return args

    def push_args(self) -> list[str]:
        """A decode worker's push settings (none unless ``kv_transfer_mode`` is "push")."""
        return ["--kv-push-layer-groups", str(self.kv_push_layer_groups)] if self.kv_transfer_mode == "push" else []

    def router_args(self) -> list[str]:
        """Flags the router gets on top of its addresses and ports."""
        name = ["--served-model-name", self.served_model_name] if self.served_model_name else []
        planner = (["--planner", *(["--slo-ttft-ms", str(self.slo_ttft_ms)] if self.slo_ttft_ms else []),
                    *(["--slo-itl-ms", str(self.slo_itl_ms)] if self.slo_itl_ms else [])] if self.planner else [])
        continuity = ["--chat-token-continuity" if self.chat_token_continuity else "--no-chat-token-continuity",
                      "--chat-token-continuity-mb", str(self.chat_token_continuity_mb)]
        return ["--policy", self.policy, "--disagg", self.disagg, "--disagg-max-stall-ms", f"{self.disagg_max_stall_ms:g}",
                "--kv-transfer-mode", self.kv_transfer_mode,
                "--decode-migrations", str(self.decode_migrations), *continuity, *name, *planner]

    def router_env(self) -> dict[str, str]:
        """Variables only the router gets: its API key (an environment variable is not visible in ``ps``)."""
        return {"PD_API_KEY": self.api_key} if self.api_key else {}

    def trace_env(self) -> dict[str, str]:
        """OTEL_* variables that make every child export traces to ``otlp_endpoint`` (none when it is None)."""
        if self.otlp_endpoint is None:
            return {}
        return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint}

    def child_env(self) -> dict[str, str]:
        """The environment every child process gets on top of the launcher's: tracing, TLS, shutdown grace."""
        return {**self.trace_env(), **tls_env(self.tls), "PD_SHUTDOWN_GRACE_S": str(self.shutdown_grace_s)}


def tls_env(tls: TlsConfig) -> dict[str, str]:
    """PD_TLS_* variables that give every child process of `splitserve up` the same TLS configuration."""
    env = {}
    for name, path in (("PD_TLS_CERT", tls.cert_file), ("PD_TLS_KEY", tls.key_file), ("PD_TLS_CA", tls.ca_file)):
        if path:
            env[name] = os.path.abspath(path)
    if tls.client_auth:
        env["PD_TLS_CLIENT_AUTH"] = "1"
    if tls.server_name:
        env["PD_TLS_SERVER_NAME"] = tls.server_name
    return env


def parse(argv: list[str] | None = None) -> UpConfig:
    """``splitserve up`` flags → :class:`UpConfig`.

    Raises:
        ValueError: a value :class:`UpConfig` or TLS refuses; :class:`~splitserve.env.EnvError` for a bad PD_* value.
        SystemExit: argparse's usage errors (2) and ``--help`` (0).
    """
    ap = new_parser("splitserve up", "Start a local disaggregated cluster.")
    ap.add_argument("--model", default=env_str("PD_MODEL", str(default_model_path())),
                    help="HF model folder, .gguf file or synthetic:NAME, for every process (PD_MODEL)")
    ap.add_argument("--served-model-name", default=env_str("PD_SERVED_MODEL_NAME"),
                    help="model name the API answers to (PD_SERVED_MODEL_NAME; default: the model folder's or file's name)")
    ap.add_argument("--api-key", default=env_str("PD_API_KEY"),
                    help="require Authorization: Bearer <key> on the router's HTTP API and RouterService; prefer setting "
                         f"PD_API_KEY (a flag shows in ps) {SECRET_DEFAULT}")
    ap.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    ap.add_argument("--decode", type=int, default=1, help="number of decode workers")
    ap.add_argument("--elastic", action="store_true", default=env_bool("PD_ELASTIC"),
                    help="start every worker as `splitserve worker`: its role can change in place (SetRole, the "
                         "router's --planner) (PD_ELASTIC)")
    ap.add_argument("--planner", action="store_true", default=env_bool("PD_PLANNER"),
                    help="the router flips the workers between prefill and decode as the load asks; needs --elastic (PD_PLANNER)")
    ap.add_argument("--slo-ttft-ms", type=float, default=env_float("PD_SLO_TTFT_MS", None),
                    help="planner: TTFT target of the p90, ms (PD_SLO_TTFT_MS; unset: not a signal)")
    ap.add_argument("--slo-itl-ms", type=float, default=env_float("PD_SLO_ITL_MS", None),
                    help="planner: ITL target of the p90, ms (PD_SLO_ITL_MS; unset: not a signal)")
    ap.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    ap.add_argument("--http-port", type=int, default=env_int("PD_HTTP_PORT", 8000),
                    help="router's OpenAI HTTP port (PD_HTTP_PORT; 0: any free port)")
    ap.add_argument("--grpc-port", type=int, default=env_int("PD_GRPC_PORT", 50050),
                    help="router's gRPC port, pd.v1.RouterService (PD_GRPC_PORT; 0: any free port)")
    ap.add_argument("--transport", default=env_choice("PD_KV_TRANSPORT", TRANSPORTS, "ucx"), choices=TRANSPORTS,
                    help="KV transfer backend between workers (PD_KV_TRANSPORT)")
    ap.add_argument("--block-size", type=int, default=env_int("PD_BLOCK_SIZE", 16), help="tokens per KV block (PD_BLOCK_SIZE)")
    ap.add_argument("--kv-cache-mb", type=int, default=env_int("PD_KV_CACHE_MB", 256),
                    help="KV block pool of each worker, MiB (PD_KV_CACHE_MB)")
    ap.add_argument("--dtype", default=env_choice("PD_DTYPE", DTYPE_CHOICES, "auto"), choices=DTYPE_CHOICES,
                    help="workers' weights and KV cache dtype (PD_DTYPE; auto: the checkpoint's; on the CPU kernels "
                         "bfloat16/float16 are weight-only: 16-bit storage, float32 arithmetic)")
    ap.add_argument("--device", default=env_str("PD_DEVICE", "cpu"),
                    help=f"every worker's compute device: {DEVICE_HELP} (PD_DEVICE; each worker checks it can use it)")
    ap.add_argument("--enforce-eager", action="store_true", default=env_bool("PD_ENFORCE_EAGER"),
                    help="workers on cuda run decode steps eagerly, without CUDA graphs (PD_ENFORCE_EAGER)")
    ap.add_argument("--max-model-len", type=int, default=env_int("PD_MAX_MODEL_LEN", 0),
                    help="workers' context limit in tokens, prompt + output (PD_MAX_MODEL_LEN; 0: the model's)")
    ap.add_argument("--max-num-seqs", type=int, default=env_int("PD_MAX_NUM_SEQS", 64),
                    help="workers' most sequences in one batch (PD_MAX_NUM_SEQS)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=env_int("PD_MAX_NUM_BATCHED_TOKENS", 0),
                    help="workers' prompt tokens per prefill batch; with --enable-chunked-prefill, tokens per step "
                         "(PD_MAX_NUM_BATCHED_TOKENS; 0: the engine's default, 4096 or 512 with chunking)")
    ap.add_argument("--enable-chunked-prefill", action="store_true", default=env_bool("PD_ENABLE_CHUNKED_PREFILL"),
                    help="workers mix running decodes and prompt chunks in each step (PD_ENABLE_CHUNKED_PREFILL)")
    ap.add_argument("--prefill-cpus", default=env_str("PD_PREFILL_CPUS", ""),
                    help="pin every prefill worker to these CPUs, e.g. 0 (PD_PREFILL_CPUS; empty: not pinned)")
    ap.add_argument("--decode-cpus", default=env_str("PD_DECODE_CPUS", ""),
                    help="pin every decode worker to these CPUs, e.g. 1 (PD_DECODE_CPUS; empty: not pinned)")
    ap.add_argument("--store-nodes", type=int, default=env_int("PD_KVSTORE_NODES", 1),
                    help="KV store storage nodes (with a master); prefix blocks are reused across requests")
    ap.add_argument("--no-store", action="store_true", help="run without the KV store (no master, no storage nodes)")
    ap.add_argument("--store-mb", type=int, default=env_int("PD_KVSTORE_SEGMENT_MB", 256), help="memory segment per storage node, MiB")
    ap.add_argument("--store-replicas", type=int, default=env_int("PD_KVSTORE_REPLICAS", 1), help="copies per object on distinct nodes")
    ap.add_argument("--kv-transfer-mode", default=env_choice("PD_KV_TRANSFER_MODE", TRANSFER_MODES, "direct"), choices=TRANSFER_MODES,
                    help="direct: decode pulls KV from prefill over UCX; store: through the KV store; "
                         "push: prefill and decode at once, prefill writes the KV into decode's blocks layer by layer")
    ap.add_argument("--kv-push-layer-groups", type=int, default=env_int("PD_KV_PUSH_LAYER_GROUPS", 0),
                    help="push mode: layer groups each decode worker asks for, each sent as soon as it is computed "
                         "(PD_KV_PUSH_LAYER_GROUPS; 0: one per layer; 1: the whole KV after the prefill)")
    ap.add_argument("--decode-migrations", type=int, default=env_int("PD_DECODE_MIGRATIONS", 1),
                    help="times the router may move a stream to another decode worker when its worker dies or stalls "
                         "mid-stream, token-exact (PD_DECODE_MIGRATIONS; 0: off)")
    ap.add_argument("--policy", default=env_choice("PD_ROUTING_POLICY", POLICIES, "round_robin"), choices=POLICIES,
                    help="router's worker selection policy")
    ap.add_argument("--disagg", default=env_str("PD_DISAGG", "always"),
                    help="always | auto | N: prompts with < N uncached tokens are prefilled on the decode worker")
    ap.add_argument("--disagg-max-stall-ms", type=float, default=env_float("PD_DISAGG_MAX_STALL_MS", 200.0),
                    help="with --disagg auto: prefill on the decode worker only prompts whose prefill stalls its running "
                         "streams for at most this long (0: no cap)")
    ap.add_argument("--shutdown-grace-s", type=float, default=env_float("PD_SHUTDOWN_GRACE_S", DEFAULT_GRACE_S),
                    help="Ctrl-C/SIGTERM: in-flight requests may finish within this many seconds (0: stop at once; "
                         "a second Ctrl-C stops at once too)")
    add_continuity_args(ap)
    ap.add_argument("--trace", action="store_true", help="every process exports OpenTelemetry traces over OTLP")
    ap.add_argument("--otlp-endpoint", help="OTLP endpoint for --trace (implies it); default $OTEL_EXPORTER_OTLP_ENDPOINT "
                    f"or {DEFAULT_OTLP_ENDPOINT} (e.g. Jaeger all-in-one)")
    add_tls_args(ap)
    a = ap.parse_args(argv)
    check_push_layer_groups(a.model, a.kv_push_layer_groups)
    otlp = None
    if a.trace or a.otlp_endpoint:
        otlp = a.otlp_endpoint or env_str("OTEL_EXPORTER_OTLP_ENDPOINT", DEFAULT_OTLP_ENDPOINT)
    return UpConfig(
        model=a.model, num_prefill=a.prefill, num_decode=a.decode, host=a.host, http_port=a.http_port,
        grpc_port=a.grpc_port, transport=a.transport, block_size=a.block_size, kv_cache_mb=a.kv_cache_mb,
        kv_transfer_mode=a.kv_transfer_mode, dtype=a.dtype, max_model_len=a.max_model_len,
        store_nodes=0 if a.no_store else a.store_nodes, store_mb=a.store_mb,
        store_replicas=a.store_replicas, policy=a.policy, disagg=a.disagg, disagg_max_stall_ms=a.disagg_max_stall_ms,
        shutdown_grace_s=a.shutdown_grace_s,
        otlp_endpoint=otlp, tls=tls_config(a), served_model_name=a.served_model_name, api_key=a.api_key,
        prefill_cpus=a.prefill_cpus, decode_cpus=a.decode_cpus, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, enable_chunked_prefill=a.enable_chunked_prefill,
        elastic=a.elastic, planner=a.planner, slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms,
        kv_push_layer_groups=a.kv_push_layer_groups, decode_migrations=a.decode_migrations,
        chat_token_continuity=a.chat_token_continuity, chat_token_continuity_mb=a.chat_token_continuity_mb,
        device=a.device, enforce_eager=a.enforce_eager,
    )
