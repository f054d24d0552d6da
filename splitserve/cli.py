"""The `splitserve` command: up | prefill | decode | router | colocated | generate | bench.

Bad settings never start anything and never print a traceback: argparse reports unknown flags and
unparsable values, and every server command first parses its arguments into its frozen config
(whose ``__post_init__`` raises ValueError for out-of-range values, missing TLS files ...) and
checks the model path; a failure prints one line, ``splitserve <command>: error: <why>``, and exits
2. ``splitserve up`` checks its own flags and then each process's arguments the same way before it
starts any of them.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from splitserve.env import EnvError, env_str

USAGE = """splitserve <command> [options]

commands:
  up         start router + prefill + decode workers + KV store as local processes (Ctrl-C stops them all)
  prefill    run one prefill worker
  decode     run one decode worker
  worker     run one worker that serves prefill, decode or both and can switch role in place (SetRole)
  role       read or switch the role of a running worker (`splitserve role host:port decode`)
  router     run the router (OpenAI HTTP API + gRPC RouterService)
  kvstore-master  run the KV store metadata master
  kvstore-node    run a KV store storage node (a memory segment served over UCX)
  colocated  serve prefill and decode in one process (reference / baseline)
  generate   stream a completion from a running router over gRPC
  bench      benchmark an endpoint; `bench compare` colocated vs disaggregated; `bench efficiency`

`splitserve <command> --help` shows each command's options; `splitserve --version` the version.
"""


# command -> (module whose main(argv) runs it, module whose parse(argv) builds its validated config)
SERVERS = {
    "prefill": ("splitserve.services.prefill.main", "splitserve.services.prefill.config"),
    "decode": ("splitserve.services.decode.main", "splitserve.services.decode.config"),
    "worker": ("splitserve.services.worker.main", "splitserve.services.worker.config"),
    "router": ("splitserve.services.router.main", "splitserve.services.router.config"),
    "colocated": ("splitserve.colocated.main", "splitserve.colocated.main"),
    "kvstore-master": ("splitserve.services.kvstore.master.main", "splitserve.services.kvstore.master.config"),
    "kvstore-node": ("splitserve.services.kvstore.node.main", "splitserve.services.kvstore.node.config"),
}


def check_settings(command: str, argv: list[str]) -> object:
    """Parse ``argv`` as ``splitserve <command>`` does, starting nothing; returns its config (no torch loaded).

    Raises:
        ValueError: a setting its config refuses, or a ``--model`` path that does not exist.
        SystemExit: argparse's own usage errors (2) and ``--help`` (0).
    """
    config = importlib.import_module(SERVERS[command][1]).parse(argv)
    model = getattr(config, "model", None)
    if not model:
        return config
    from splitserve.model.synthetic import SYNTHETIC_CONFIGS, SYNTHETIC_PREFIX, is_synthetic

    if is_synthetic(model):
        if model.removeprefix(SYNTHETIC_PREFIX) not in SYNTHETIC_CONFIGS:
            raise ValueError(f"--model: unknown synthetic model {model!r}; known: "
                             + ", ".join(SYNTHETIC_PREFIX + name for name in SYNTHETIC_CONFIGS))
    elif not Path(model).exists():
        raise ValueError(f"--model: no such file or directory: {model}")
    else:
        _check_model_files(Path(model))
    return config


def _check_model_files(path: Path) -> None:
    """What a model must have for every process to load it (reading no weights). Raises ValueError."""
    if path.is_dir():
        for name, why in (("config.json", "not a Hugging Face model folder"),
                          ("tokenizer.json", "only fast tokenizers are supported")):
            if not (path / name).is_file():
                raise ValueError(f"--model: {path} has no {name} ({why})")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"--model: {path} has no *.safetensors weights")
    elif path.suffix.lower() != ".gguf":
        raise ValueError(f"--model: {path} is neither a model folder nor a .gguf file")


def usage_error(command: str, message: object) -> NoReturn:
    """Print ``splitserve <command>: error: <message>`` (argparse's form) and exit 2."""
    print(f"splitserve {command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _serve(command: str, argv: list[str]) -> None:
    try:
        config = check_settings(command, argv)
        from splitserve.engine.device import check_device_available

        check_device_available(getattr(getattr(config, "engine", config), "device", "cpu"))  # this machine has that GPU
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
    from splitserve.config_checks import check_port_free
    from splitserve.launcher import up_cluster
    from splitserve.logs import setup_logging
    from splitserve.up_config import parse

    try:
        config = parse(argv)
        cluster, http_port, grpc_port = up_cluster(config)
        for child in cluster.children:  # every process's settings, before any starts
            try:
                check_settings(*_child_command(child.argv))
            except ValueError as exc:
                raise ValueError(f"{child.name}: {exc}") from None
        check_port_free("HTTP", config.host, http_port)  # one line now, not tracebacks after the workers started
        check_port_free("gRPC", config.host, grpc_port)
    except ValueError as exc:
        usage_error("up", exc)
    setup_logging("up")
    log = logging.getLogger("splitserve.up")
    stopping = False

    def on_signal(signum, frame):
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
    print(_up_banner(config, cluster, http_port, grpc_port), flush=True)
    code = 0
    while not stopping:
        for child in cluster.dead():
            log.error("%s (pid %d) exited with code %s", child.name, child.proc.pid, child.proc.returncode)
            if child.name == "router":
                stopping, code = True, 1
        time.sleep(0.3)
    log.info("stopping the cluster: draining requests in flight (up to %.0f s; Ctrl-C again to stop at once)",
             config.shutdown_grace_s)
    cluster.stop()
    return code


def _up_banner(config, cluster, http_port: int, grpc_port: int) -> str:
    """What ``splitserve up`` prints once the cluster is healthy: endpoints, metrics, traces, store, and example
    commands that work as printed (with an API key, in a shell where PD_API_KEY holds it; the key is never printed)."""
    from splitserve.launcher import store_health
    from splitserve.up_config import tls_env

    a, env = config, env_str
    base = f"http://{a.host}:{http_port}/v1"
    auth = ' -H "Authorization: Bearer $PD_API_KEY"' if a.api_key else ""
    key_note = "  # the API key: both commands read it from $PD_API_KEY (export PD_API_KEY=<the key>)\n" if a.api_key else ""
    model_name = a.served_model_name or os.path.basename(a.model.rstrip("/")).removesuffix(".gguf")
    body = json.dumps({"model": model_name, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True})
    store = (f"KV store ({a.kv_transfer_mode} KV transfer, {a.store_replicas} replica(s)):\n{store_health(cluster)}\n"
             if a.store_nodes else "KV store: off\n")
    tls = a.tls
    grpc_security = (", mutual TLS on every gRPC hop" if tls.client_auth else ", TLS on every gRPC hop") if tls.enabled else ""
    child_tls = tls_env(tls)
    generate_tls = "".join(f" --{flag} {child_tls[name]}" for flag, name in (("tls-cert", "PD_TLS_CERT"), ("tls-key", "PD_TLS_KEY"),
                                                                          ("tls-ca", "PD_TLS_CA")) if name in child_tls)
    metrics = "\n               ".join(f"{c.metrics}  ({c.name})" for c in cluster.children if c.metrics)
    otlp = a.otlp_endpoint or env("OTEL_EXPORTER_OTLP_ENDPOINT")
    traces = f"OTLP to {otlp}" if otlp and env("OTEL_SDK_DISABLED", "").lower() != "true" else "off (--trace to export them)"
    return (
        f"\nsplitserve is up: {a.num_prefill} prefill + {a.num_decode} decode workers"
        f"{(' (role can change' + (', planner on)' if a.planner else ')')) if a.elastic else ''}, model {a.model}\n"
        f"  OpenAI API : {base}\n  gRPC       : {a.host}:{grpc_port} (pd.v1.RouterService){grpc_security}\n"
        f"  Metrics    : {metrics}\n  Traces     : {traces}\n{store}\n"
        f"try:\n{key_note}  curl -sN {base}/completions -H 'Content-Type: application/json'"
        f"{auth} \\\n    -d {shlex.quote(body)}\n"
        f"  {self_command()} generate --router {a.host}:{grpc_port}{generate_tls} \"Once upon a time\"\n\nCtrl-C stops the cluster.\n"
    )


def self_command() -> str:
    """How to run this splitserve again from the current shell: ``splitserve`` when that is what PATH finds,
    else the path this process was started with (e.g. ``.venv/bin/splitserve`` when the venv is not
    activated)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) != "splitserve" or not os.path.isfile(argv0):
        return "splitserve"
    on_path = shutil.which("splitserve")
    if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
        return "splitserve"
    rel = os.path.relpath(argv0)
    if rel.startswith(".."):
        rel = os.path.abspath(argv0)
    elif os.sep not in rel:
        rel = os.path.join(".", rel)
    return shlex.quote(rel)


def _generate(argv: list[str]) -> int:
    import grpc

    from splitserve.cli_help import SECRET_DEFAULT, new_parser
    from splitserve.client import RouterClient
    from splitserve.engine.sampling import seed_from_signed
    from splitserve.rpc.tls import add_tls_args, tls_config

    ap = new_parser("splitserve generate", "Stream a completion from a router over gRPC.")
    ap.add_argument("prompt", help="prompt text")
    ap.add_argument("--router", default=env_str("PD_ROUTER_GRPC", "127.0.0.1:50050"), help="router gRPC host:port (PD_ROUTER_GRPC)")
    ap.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest token set with this probability mass")
    ap.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1: all")
    ap.add_argument("--seed", type=int, help="sampling seed, signed 64-bit; a negative one draws as seed mod 2**63 "
                    "(default: none, a random one)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeat the flag for several)")
    ap.add_argument("--api-key", default=env_str("PD_API_KEY"), help=f"router API key; prefer PD_API_KEY {SECRET_DEFAULT}")
    add_tls_args(ap)
    a = ap.parse_args(argv)
    if a.max_tokens < 1:
        usage_error("generate", f"--max-tokens must be >= 1, got {a.max_tokens}")
    try:
        if a.seed is not None:
            seed_from_signed(a.seed)
    except ValueError as exc:
        usage_error("generate", f"--{exc}")
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


def version() -> str:
    """The installed package's version, or pyproject.toml's in a source tree that is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("splitserve")
    except PackageNotFoundError:
        import re

        from splitserve.paths import REPO_ROOT

        found = re.search(r'^version\s*=\s*"([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
        return found.group(1) if found else "unknown"


def main(argv: list[str] | None = None) -> None:
    from splitserve.parent_death import arm_from_env

    arm_from_env()  # started by a launcher: die with it
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        print(f"splitserve {version()}")
        sys.exit(0)
    command, rest = argv[0], argv[1:]
    try:
        _run(command, rest)
    except EnvError as exc:  # a bad PD_* value read outside a config's parse (e.g. PD_LOG_LEVEL at start-up)
        usage_error(command, exc)


def _run(command: str, rest: list[str]) -> None:
    if command == "up":
        sys.exit(_up(rest))
    if command == "generate":
        sys.exit(_generate(rest))
    if command == "role":
        from splitserve.services.worker.role_cli import main as role

        sys.exit(role(rest))
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
