"""The `splitserve` command: up | prefill | decode | router | colocated | generate."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

USAGE = """splitserve <command> [options]

commands:
  up         start router + prefill + decode workers as local processes (Ctrl-C stops them all)
  prefill    run one prefill worker
  decode     run one decode worker
  router     run the router (OpenAI HTTP API + gRPC RouterService)
  colocated  serve prefill and decode in one process (reference / baseline)
  generate   stream a completion from a running router over gRPC

`splitserve <command> --help` shows each command's options.
"""


def _up(argv: list[str]) -> int:
    from splitserve.launcher import build_cluster
    from splitserve.logs import setup_logging
    from splitserve.paths import default_model_path

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
    a = ap.parse_args(argv)
    setup_logging("up")
    log = logging.getLogger("splitserve.up")
    worker_args = ["--transport", a.transport, "--block-size", str(a.block_size), "--kv-cache-mb", str(a.kv_cache_mb)]
    cluster, http_port, grpc_port = build_cluster(
        model=a.model, num_prefill=a.prefill, num_decode=a.decode, host=a.host,
        http_port=a.http_port, grpc_port=a.grpc_port, worker_args=worker_args,
    )
    stopping = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal stopping
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
    print(
        f"\nsplitserve is up: {a.prefill} prefill + {a.decode} decode workers, model {a.model}\n"
        f"  OpenAI API : {base}\n  gRPC       : {a.host}:{grpc_port} (pd.v1.RouterService)\n\n"
        f"try:\n  curl -sN {base}/completions -H 'Content-Type: application/json'"
        f"{auth} \\\n"
        f"    -d '{{\"model\": \"{os.path.basename(a.model.rstrip('/')).removesuffix('.gguf')}\", \"prompt\": \"Once upon a time\", "
        f"\"max_tokens\": 48, \"temperature\": 0, \"stream\": true}}'\n"
        f"  splitserve generate --router {a.host}:{grpc_port} \"Once upon a time\"\n\nCtrl-C stops the cluster.\n",
        flush=True,
    )
    code = 0
    while not stopping:
        for child in cluster.dead():
            log.error("%s (pid %d) exited with code %s", child.name, child.proc.pid, child.proc.returncode)
            if child.name == "router":
                stopping, code = True, 1
        time.sleep(0.3)
    log.info("stopping the cluster")
    cluster.stop()
    return code


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

    async def run() -> None:
        async with RouterClient(a.router, tls=tls_config(a), api_key=a.api_key) as client:
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
    if command == "prefill":
        from splitserve.services.prefill.main import main as run
    elif command == "decode":
        from splitserve.services.decode.main import main as run
    elif command == "router":
        from splitserve.services.router.main import main as run
    elif command == "colocated":
        from splitserve.colocated.main import main as run
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    run(rest)


if __name__ == "__main__":
    main()
