"""KV store master process: gRPC KVStoreMasterService + health, and the background sweep."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import kvstore_pb2, kvstore_pb2_grpc

from splitserve.logs import setup_logging
from splitserve.rpc import keepalive
from splitserve.rpc.server import bind, create_server, set_serving, stop_event_on_signals
from splitserve.services.kvstore.master.config import MasterConfig, parse
from splitserve.services.kvstore.master.core import KVStoreMaster
from splitserve.services.kvstore.master.server import KVStoreMasterServicer
from splitserve.telemetry.exposition import start_metrics_server
from splitserve.telemetry.stats_collector import register_stats

_MASTER_GAUGES = {"segments", "capacity_bytes", "used_bytes", "objects", "objects_complete", "objects_processing"}

logger = logging.getLogger("splitserve.kvstore.master")
SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreMasterService"].full_name


async def serve(config: MasterConfig) -> None:
    keepalive.configure(config.keepalive)
    master = KVStoreMaster(config)
    servicer = KVStoreMasterServicer(master)
    register_stats("kv_store", master.stats, _MASTER_GAUGES, doc="KV store master")
    metrics = start_metrics_server(config.host, config.metrics_port)
    server, health = create_server()
    kvstore_pb2_grpc.add_KVStoreMasterServiceServicer_to_server(servicer, server)
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    ticks = asyncio.create_task(servicer.run_ticks())
    await set_serving(health, [SERVICE])
    logger.info(
        "kvstore master ready: grpc %s:%d%s, %d replica(s), lease %.1fs, put timeout %.1fs, heartbeat timeout %.1fs, metrics %s",
        config.host, port, " (tls)" if config.tls.enabled else "", config.default_replicas, config.lease_s, config.put_timeout_s,
        config.heartbeat_timeout_s,
        metrics.url if metrics else "off",
    )
    stop = stop_event_on_signals()
    try:
        await stop.wait()
    finally:
        logger.info("kvstore master stopping")
        await set_serving(health, [SERVICE], serving=False)
        ticks.cancel()
        await server.stop(grace=2)
        if metrics:
            metrics.close()


def main(argv: list[str] | None = None) -> None:
    setup_logging("kvmaster")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
