"""`splitserve colocated`: the same engine and HTTP/gRPC API in one process (reference and baseline)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from pathlib import Path

from pd.v1 import router_pb2_grpc

from splitserve.cli_help import SECRET_DEFAULT, new_parser
from splitserve.env import env_int, env_str
from splitserve.config_checks import check_port
from splitserve.engine.args import add_engine_args, engine_config
from splitserve.colocated.backend import LocalBackend
from splitserve.engine.async_engine import AsyncEngine, set_torch_threads
from splitserve.frontend.continuity_args import add_continuity_args, build_continuity, check_continuity_mb
from splitserve.frontend.draining import DrainMiddleware
from splitserve.frontend.grpc_api import RouterServicer
from splitserve.frontend.http_app import build_app
from splitserve.frontend.http_server import HttpLimits, http_server
from splitserve.logs import setup_logging
from splitserve.model import load_model
from splitserve.rpc import keepalive
from splitserve.rpc.keepalive import add_keepalive_args, keepalive_config
from splitserve.rpc.server import bind, create_server, set_serving
from splitserve.rpc.shutdown import Drain, add_shutdown_args, check_grace, serve_until_signalled
from splitserve.rpc.tls import add_tls_args, tls_config
from splitserve.cpus import check_cpus, pin_process
from splitserve.served_model import ServedModel
from splitserve.telemetry.asgi import instrument_app, metrics_route
from splitserve.telemetry.exposition import register_engine
from splitserve.telemetry.tracing import setup_tracing
from splitserve.telemetry.stats_log import add_stats_log_arg, start_stats_log

logger = logging.getLogger("splitserve.colocated")


async def serve(args: argparse.Namespace) -> None:
    keepalive.configure(keepalive_config(args))
    threads = set_torch_threads(args.torch_threads, pin_process(args.cpus), owns_machine=True)
    logger.info("%d torch threads", threads)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    engine = AsyncEngine(lm, engine_config(args))
    await engine.start()
    backend = LocalBackend(engine)
    served = ServedModel(args.served_model_name or Path(args.model).name.removesuffix(".gguf"), lm.tokenizer, engine.max_model_len)
    api_key = args.api_key or None
    drain = Drain()  # graceful shutdown (as the router's)
    server, health = create_server(api_key=api_key, protected_services=["pd.v1.RouterService"], drain=drain,
                                   work_methods=["/pd.v1.RouterService/Generate"])
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(backend, lm.tokenizer, engine.max_model_len, served.name), server)
    grpc_port = bind(server, args.host, args.grpc_port, tls_config(args))
    register_engine(engine)
    await server.start()
    continuity = build_continuity(lm.tokenizer, args.chat_token_continuity, args.chat_token_continuity_mb)
    app = DrainMiddleware(instrument_app(build_app(served, backend, api_key=api_key, extra_routes=[metrics_route()],
                                                   token_continuity=continuity)), drain)
    http = http_server(app, args.host, args.http_port, args.http_limits)  # read deadlines, connection cap (PD_HTTP_*)
    http_task = asyncio.create_task(http.serve())
    gc.collect()  # start-up objects to the permanent generation: full collections stop walking them (gc.freeze)
    gc.freeze()
    await set_serving(health, ["pd.v1.RouterService"])
    logger.info("colocated server ready: http http://%s:%d/v1, grpc %s:%d, model %s", args.host, args.http_port, args.host, grpc_port, lm.model_id)
    serving = asyncio.create_task(serve_until_signalled(server, health, ["pd.v1.RouterService"], drain,
                                                        grace_s=args.shutdown_grace_s, name="colocated server"))
    stats_log = start_stats_log("colocated", engine.stats, args.stats_log_interval_s)
    try:
        await asyncio.wait([serving, http_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stats_log is not None:
            stats_log.cancel()
        serving.cancel()
        http.should_exit = True
        await server.stop(grace=0)
        await http_task
        await engine.stop()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` exits 0, usage errors exit 2). Raises ValueError for bad settings."""
    ap = new_parser("splitserve colocated", "Serve prefill and decode in one process.")
    add_engine_args(ap)
    ap.add_argument("--served-model-name", default=env_str("PD_SERVED_MODEL_NAME"),
                    help="model name the API answers to (default: the model folder's or file's name)")
    ap.add_argument("--host", default=env_str("PD_HOST", "127.0.0.1"), help="address the HTTP and gRPC servers listen on")
    ap.add_argument("--http-port", type=int, default=env_int("PD_HTTP_PORT", 8000), help="OpenAI HTTP API port (0: any free port)")
    ap.add_argument("--grpc-port", type=int, default=env_int("PD_GRPC_PORT", 50050),
                    help="gRPC port of pd.v1.RouterService (0: any free port)")
    ap.add_argument("--api-key", default=env_str("PD_API_KEY"),
                    help=f"require Authorization: Bearer <key>; prefer PD_API_KEY {SECRET_DEFAULT}")
    add_continuity_args(ap)
    add_tls_args(ap)
    add_keepalive_args(ap)
    add_shutdown_args(ap)
    add_stats_log_arg(ap)
    args = ap.parse_args(argv)
    if not args.stats_log_interval_s >= 0:
        raise ValueError(f"--stats-log-interval-s must be >= 0 (0: off), got {args.stats_log_interval_s}")
    engine_config(args)  # the frozen configs validate themselves (ValueError)
    if args.cpus:
        check_cpus(args.cpus)
    tls_config(args)
    keepalive_config(args)
    check_grace(args.shutdown_grace_s)
    check_continuity_mb(args.chat_token_continuity_mb)
    check_port("--http-port", args.http_port)
    check_port("--grpc-port", args.grpc_port)
    args.http_limits = HttpLimits.from_env()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    setup_logging("coloc")
    setup_tracing("splitserve-colocated")
    asyncio.run(serve(args))
