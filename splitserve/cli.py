"""The `splitserve` command: up | prefill | decode | router | colocated | generate | bench.

Bad settings never start anything and never print a traceback: argparse reports unknown flags and
unparsable values, and every server command first parses its arguments into its frozen config
(whose ``__post_init__`` raises ValueError for out-of-range values, missing TLS files ...) and
checks the model path; a failure prints one line, ``splitserve <command>: error: <why>``, and exits
2. ``splitserve up`` checks its own flags and then each process's arguments the same way before it
starts any of them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

USAGE = """splitserve <command> [options]

commands:
  up         start router + prefill + decode workers + KV store as local processes (Ctrl-C stops them all)
  prefill    run one prefill worker
  decode     run one decode worker
  router     run the router (OpenAI HTTP API + gRPC RouterService)
  kvstore-master  run the KV store metadata master
  kvstore-node    run a KV store storage node (a memory segment served over UCX)
  colocated  serve prefill and decode in one process (reference / baseline)
  generate   stream a completion from a running router over gRPC
  bench      benchmark an endpoint; `bench compare` colocated vs disaggregated; `bench efficiency`

`splitserve <command> --help` shows each command's options.
"""


# command -> (module whose main(argv) runs it, module whose parse(argv) builds its validated config)
SERVERS = {
    "prefill": ("splitserve.services.prefill.main", "splitserve.services.prefill.config"),
    "decode": ("splitserve.services.decode.main", "splitserve.services.decode.config"),
    "router": ("splitserve.services.router.main", "splitserve.services.router.config"),
    "colocated": ("splitserve.colocated.main", "splitserve.colocated.main"),
    "kvstore-master": ("splitserve.services.kvstore.master.main", "splitserve.services.kvstore.master.config"),
    "kvstore-node": ("splitserve.services.kvstore.node.main", "splitserve.services.kvstore.node.config"),
}


def check_settings(command: str, argv: list[str]) -> None:
    """Parse ``argv`` as ``splitserve <command>`` does, starting nothing.

    Raises:
        ValueError: a setting its config refuses, or a ``--model`` path that does not exist.
        SystemExit: argparse's own usage errors (2) and ``--help`` (0).
    """
    config = importlib.import_module(SERVERS[command][1]).parse(argv)
    model = getattr(config, "model", None)
    if not model:
        return
    from splitserve.model.synthetic import SYNTHETIC_CONFIGS, SYNTHETIC_PREFIX, is_synthetic

    if is_synthetic(model):
        if model.removeprefix(SYNTHETIC_PREFIX) not in SYNTHETIC_CONFIGS:
            raise ValueError(f"--model: unknown synthetic model {model!r}; known: "
                             + ", ".join(SYNTHETIC_PREFIX + name for name in SYNTHETIC_CONFIGS))
    elif not Path(model).exists():
        raise ValueError(f"--model: no such file or directory: {model}")


def usage_error(command: str, message: object) -> NoReturn:
    """Print ``splitserve <command>: error: <message>`` (argparse's form) and exit 2."""
    print(f"splitserve {command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _serve(command: str, argv: list[str]) -> None:
    try:
        check_settings(command, argv)
    except ValueError as exc:
        usage_error(command, exc)
    from splitserve.rpc.server import BindError

    try:
        importlib.import_module(SERVERS[command][0]).main(argv)
    except BindError as exc:  # e.g. the port is taken: one line, not a traceback
        print(f"splitserve {command}: error: {exc}", file=sys.stderr)
        sys.exit(1)


def _child_command(argv: list[str]) -> tuple[str, list[str]]:
    i = argv.index("splitserve.cli") + 1
    return argv[i], argv[i + 1 :]


def _up(argv: list[str]) -> int:
    from splitserve.launcher import build_cluster, store_health
    from splitserve.logs import setup_logging
    from splitserve.paths import default_model_path
    from splitserve.rpc.tls import add_tls_args, tls_config

    env = os.environ.get
    ap = argparse.ArgumentParser(prog="splitserve up", description="Start a local disaggregated cluster.")
    ap.add_argument("--model", default=env("PD_MODEL", str(default_model_path())))
    ap.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    ap.add_argument("--decode", type=int, default=1, help="number of decode workers")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=int(env("PD_HTTP_PORT", "8000")))
    ap.add_argument("--grpc-port", type=int, default=int(env("PD_GRPC_PORT", "50050")))
    ap.add_argument("--transport", default=env("PD_KV_TRANSPORT", "ucx"), choices=["ucx"])
    ap.add_argument("--block-size", type=int, default=int(env("PD_BLOCK_SIZE", "16")))
    ap.add_argument("--kv-cache-mb", type=int, default=int(env("PD_KV_CACHE_MB", "256")))
    ap.add_argument("--dtype", default=env("PD_DTYPE", "auto"), choices=["auto", "float32", "bfloat16", "float16"], help="workers' weights and KV dtype (see `splitserve prefill -h`)")
    ap.add_argument("--max-model-len", type=int, default=int(env("PD_MAX_MODEL_LEN", "0")), help="workers' context limit, tokens (0: the model's)")
    ap.add_argument("--store-nodes", type=int, default=int(env("PD_KVSTORE_NODES", "1")),
                    help="KV store storage nodes (with a master); prefix blocks are reused across requests")
    ap.add_argument("--no-store", action="store_true", help="run without the KV store (no master, no storage nodes)")
    ap.add_argument("--store-mb", type=int, default=int(env("PD_KVSTORE_SEGMENT_MB", "256")), help="memory segment per storage node, MiB")
    ap.add_argument("--store-replicas", type=int, default=int(env("PD_KVSTORE_REPLICAS", "1")), help="copies per object on distinct nodes")
    ap.add_argument("--kv-transfer-mode", default=env("PD_KV_TRANSFER_MODE", "direct"), choices=["direct", "store"],
                    help="direct: decode pulls KV from prefill over UCX; store: through the KV store")
    ap.add_argument("--policy", default=env("PD_ROUTING_POLICY", "round_robin"), choices=["round_robin", "least_loaded", "prefix_aware"],
                    help="router's worker selection policy")
    ap.add_argument("--disagg", default=env("PD_DISAGG", "always"),
                    help="always | auto | N: prompts with < N uncached tokens are prefilled on the decode worker")
    ap.add_argument("--shutdown-grace-s", type=float, default=float(env("PD_SHUTDOWN_GRACE_S") or 30.0),
                    help="Ctrl-C/SIGTERM: in-flight requests may finish within this many seconds (0: stop at once; "
                         "a second Ctrl-C stops at once too)")
    ap.add_argument("--trace", action="store_true", help="every process exports OpenTelemetry traces over OTLP")
    ap.add_argument("--otlp-endpoint", help="OTLP endpoint for --trace (implies it); default $OTEL_EXPORTER_OTLP_ENDPOINT "
                    "or http://127.0.0.1:4317 (e.g. Jaeger all-in-one)")
    add_tls_args(ap)  # one TLS configuration for every gRPC server and channel of the cluster (store included)
    a = ap.parse_args(argv)
    store_nodes = 0 if a.no_store else a.store_nodes
    try:
        tls = tls_config(a)
    except ValueError as exc:
        ap.error(str(exc))
    if tls.enabled and not tls.cert_file:
        ap.error("TLS: the cluster's gRPC servers need --tls-cert and --tls-key (PD_TLS_CERT, PD_TLS_KEY)")
    if a.kv_transfer_mode == "store" and not store_nodes:
        usage_error("up", "--kv-transfer-mode store needs the KV store (drop --no-store, --store-nodes >= 1)")
    if store_nodes < 0:
        usage_error("up", f"--store-nodes must be >= 0, got {store_nodes}")
    if store_nodes and a.store_replicas > store_nodes:
        usage_error("up", f"--store-replicas {a.store_replicas} needs at least as many storage nodes (--store-nodes {store_nodes})")
    if a.http_port and a.http_port == a.grpc_port:
        usage_error("up", f"--http-port and --grpc-port must differ, both are {a.http_port}")
    if not a.shutdown_grace_s >= 0:
        usage_error("up", f"--shutdown-grace-s must be >= 0, got {a.shutdown_grace_s}")
    setup_logging("up")
    log = logging.getLogger("splitserve.up")
    trace_env = {}
    if a.trace or a.otlp_endpoint:
        endpoint = a.otlp_endpoint or env("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://127.0.0.1:4317"
        trace_env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    tls_env = _tls_env(tls)
    worker_args = ["--transport", a.transport, "--block-size", str(a.block_size), "--kv-cache-mb", str(a.kv_cache_mb),
                   "--kv-transfer-mode", a.kv_transfer_mode, "--dtype", a.dtype, "--max-model-len", str(a.max_model_len)]
    try:
        cluster, http_port, grpc_port = build_cluster(
            model=a.model, num_prefill=a.prefill, num_decode=a.decode, host=a.host,
            http_port=a.http_port, grpc_port=a.grpc_port, worker_args=worker_args, env={**trace_env, **tls_env, "PD_SHUTDOWN_GRACE_S": str(a.shutdown_grace_s)},
            store_nodes=store_nodes, master_args=["--replicas", str(a.store_replicas)], node_args=["--segment-mb", str(a.store_mb)],
            router_args=["--policy", a.policy, "--disagg", a.disagg],
        )
        for child in cluster.children:  # every process's settings, before any starts
            try:
                check_settings(*_child_command(child.argv))
            except ValueError as exc:
                raise ValueError(f"{child.name}: {exc}") from None
    except ValueError as exc:
        usage_error("up", exc)
    stopping = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal stopping
        if stopping:  # a second Ctrl-C: every process stops now, without waiting for requests in flight
            cluster.interrupt()
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start()
    try:
        cluster.wait_healthy()
    except RuntimeError as exc:
        log.error("cluster failed to start: %s", exc)
        cluster.stop()
        return 1
    base = f"http://{a.host}:{http_port}/v1"
    auth = ' -H "Authorization: Bearer $PD_API_KEY"' if env("PD_API_KEY") else ""
    store = (f"KV store ({a.kv_transfer_mode} KV transfer, {a.store_replicas} replica(s)):\n{store_health(cluster)}\n"
             if store_nodes else "KV store: off\n")
    grpc_security = (", mutual TLS on every gRPC hop" if tls.client_auth else ", TLS on every gRPC hop") if tls.enabled else ""
    generate_tls = "".join(f" --{flag} {tls_env[name]}" for flag, name in (("tls-cert", "PD_TLS_CERT"), ("tls-key", "PD_TLS_KEY"),
                                                                        ("tls-ca", "PD_TLS_CA")) if name in tls_env)
    metrics = "\n               ".join(f"{c.metrics}  ({c.name})" for c in cluster.children if c.metrics)
    otlp = trace_env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env("OTEL_EXPORTER_OTLP_ENDPOINT")
    traces = f"OTLP to {otlp}" if otlp and env("OTEL_SDK_DISABLED", "").lower() != "true" else "off (--trace to export them)"
    print(
        f"\nsplitserve is up: {a.prefill} prefill + {a.decode} decode workers, model {a.model}\n"
        f"  OpenAI API : {base}\n  gRPC       : {a.host}:{grpc_port} (pd.v1.RouterService){grpc_security}\n"
        f"  Metrics    : {metrics}\n  Traces     : {traces}\n{store}\n"
        f"try:\n  curl -sN {base}/completions -H 'Content-Type: application/json'"
        f"{auth} \\\n"
        f"    -d '{{\"model\": \"{os.path.basename(a.model.rstrip('/')).removesuffix('.gguf')}\", \"prompt\": \"Once upon a time\", "
        f"\"max_tokens\": 48, \"temperature\": 0, \"stream\": true}}'\n"
        f"  splitserve generate --router {a.host}:{grpc_port}{generate_tls} \"Once upon a time\"\n\nCtrl-C stops the cluster.\n",
        flush=True,
    )
    code = 0
    while not stopping:
        for child in cluster.dead():
            log.error("%s (pid %d) exited with code %s", child.name, child.proc.pid, child.proc.returncode)
            if child.name == "router":
                stopping, code = True, 1
        time.sleep(0.3)
    log.info("stopping the cluster: draining requests in flight (up to %.0f s; Ctrl-C again to stop at once)", a.shutdown_grace_s)
    cluster.stop()
    return code


def _tls_env(tls) -> dict[str, str]:
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


def _generate(argv: list[str]) -> int:
    import grpc

    from splitserve.client import RouterClient
    from splitserve.rpc.tls import add_tls_args, tls_config

    ap = argparse.ArgumentParser(prog="splitserve generate", description="Stream a completion from a router over gRPC.")
    ap.add_argument("prompt")
    ap.add_argument("--router", default=os.environ.get("PD_ROUTER_GRPC", "127.0.0.1:50050"), help="router gRPC host:port")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--api-key", default=os.environ.get("PD_API_KEY"), help="router API key (prefer PD_API_KEY)")
    add_tls_args(ap)
    a = ap.parse_args(argv)
    if a.max_tokens < 1:
        usage_error("generate", f"--max-tokens must be >= 1, got {a.max_tokens}")
    try:
        tls = tls_config(a)
    except ValueError as exc:
        usage_error("generate", exc)

    async def run() -> None:
        async with RouterClient(a.router, tls=tls, api_key=a.api_key) as client:
            async for delta in client.generate(a.prompt, max_tokens=a.max_tokens, temperature=a.temperature,
                                               top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=a.stop):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(run())
    except grpc.aio.AioRpcError as exc:  # print the status, not a traceback
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "up":
        sys.exit(_up(rest))
    if command == "generate":
        sys.exit(_generate(rest))
    if command in SERVERS:
        _serve(command, rest)
    elif command == "bench":
        from splitserve.bench.cli import main as run

        run(rest)
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
