"""Router process: OpenAI-compatible HTTP (uvicorn) and RouterService gRPC in one asyncio loop."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import router_pb2, router_pb2_grpc

from splitserve.services.router.routing import build_backend, workers_route
from splitserve.services.router.config import RouterConfig, parse
from splitserve.services.router.planner_loop import Planner
from splitserve.frontend.grpc_api import RouterServicer
from splitserve.frontend.continuity_args import build_continuity
from splitserve.frontend.draining import DrainMiddleware
from splitserve.frontend.http_app import build_app
from splitserve.frontend.http_server import http_server
from splitserve.logs import setup_logging
from splitserve.rpc import keepalive
from splitserve.rpc.server import bind, create_server, set_serving
from splitserve.rpc.shutdown import Drain, serve_until_signalled
from splitserve.served_model import load_served_model
from splitserve.telemetry.asgi import instrument_app, metrics_route
from splitserve.telemetry.interceptors import untraced
from splitserve.telemetry.tracing import setup_tracing

logger = logging.getLogger("splitserve.router")
SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


async def serve(config: RouterConfig) -> None:
    keepalive.configure(config.keepalive)
    served = load_served_model(config.model, config.served_model_name)
    backend = build_backend(config)  # registry + policy + conditional disaggregation + failover (+ deadlines)
    backend.start()
    planner = Planner(backend.registry, config.planner) if config.planner else None  # --planner: flips --workers' roles
    drain = Drain()  # graceful shutdown: counts Generate calls and HTTP requests, refuses new ones once draining
    server, health = create_server(api_key=config.api_key, protected_services=[SERVICE], drain=drain,
                                   work_methods=[f"/{SERVICE}/Generate"])
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(backend, served.tokenizer, served.max_model_len, served.name), server)
    grpc_port = bind(server, config.host, config.grpc_port, config.tls)
    await server.start()
    app = DrainMiddleware(instrument_app(build_app(  # /metrics; HTTP spans if tracing
        served, backend, extra_routes=[metrics_route("frontend", "router", *(["planner"] if planner else [])),
                                       workers_route(backend, planner=planner)],
        api_key=config.api_key, request_timeout_s=config.request_timeout_s,
        token_continuity=build_continuity(served.tokenizer, config.chat_token_continuity, config.chat_token_continuity_mb),
    )), drain)
    http = http_server(app, config.host, config.http_port, config.http)  # read deadlines, connection cap (PD_HTTP_*)
    http_task = asyncio.create_task(http.serve())
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    if http_task.done():
        await server.stop(0)
        raise SystemExit(f"router: HTTP server failed to start on {config.host}:{config.http_port}")
    with untraced():  # start-up polling, not request traffic: no error spans while workers start
        layout_check = asyncio.create_task(backend.check_layouts())  # workers may still be starting
    await set_serving(health, [SERVICE])
    if planner is not None:
        planner.start()
    logger.info(
        "router ready: http http://%s:%d/v1, grpc %s:%d%s, model %s, prefill %s, decode %s%s%s",
        config.host, config.http_port, config.host, grpc_port, " (tls)" if config.tls.enabled else "", served.name,
        ",".join(config.prefill), ",".join(config.decode),
        f", workers (role can change) {','.join(config.workers)}" if config.workers else "",
        ", API key required" if config.api_key else "",
    )
    try:  # SIGTERM: /health and the gRPC health go 503 / NOT_SERVING, new requests are refused, in-flight ones finish
        await serve_until_signalled(server, health, [SERVICE], drain, grace_s=config.shutdown_grace_s, name="router")
    finally:
        layout_check.cancel()
        if planner is not None:
            await planner.close()
        http.should_exit = True
        await server.stop(grace=0)
        await http_task
        await backend.close()
        logger.info("router stopped")


def main(argv: list[str] | None = None) -> None:
    setup_logging("router")
    setup_tracing("splitserve-router")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
