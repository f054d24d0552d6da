"""Storage node process: a UCX segment server, its gRPC health/stats, and membership at the master."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import kvstore_pb2, kvstore_pb2_grpc

from splitserve.logs import setup_logging
from splitserve.rpc import keepalive
from splitserve.rpc.server import bind, channel as grpc_channel, create_server, set_serving, stop_event_on_signals
from splitserve.services.kvstore.node.config import NodeConfig, parse
from splitserve.services.kvstore.node.segment_server import SegmentServer
from splitserve.services.kvstore.node.server import KVStoreNodeServicer, Membership

logger = logging.getLogger("splitserve.kvstore.node")
SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreNodeService"].full_name


async def serve(config: NodeConfig) -> None:
    from splitserve.telemetry.exposition import start_metrics_server
    from splitserve.telemetry.stats_collector import register_stats

    keepalive.configure(config.keepalive)
    segment = SegmentServer(config.segment_mb * 2**20, host=config.data_host, port=config.data_port, io_timeout_s=config.io_timeout_s)
    await segment.start()
    channel = grpc_channel(config.master, config.tls)  # TLS (client certificate) when configured
    membership = Membership(kvstore_pb2_grpc.KVStoreMasterServiceStub(channel), config.node_id, segment.endpoint,
                            segment.nbytes, config.rpc_timeout_s)
    server, health = create_server()
    kvstore_pb2_grpc.add_KVStoreNodeServiceServicer_to_server(KVStoreNodeServicer(segment, membership), server)
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    register_stats("kv_store_node", lambda: {f"ucx_{k}": v for k, v in segment.stats.as_dict().items()}, doc="KV store node")
    metrics = start_metrics_server(config.host, config.metrics_port)
    heartbeats = asyncio.create_task(membership.run())
    stop = stop_event_on_signals()
    try:
        while not membership.mounted and not stop.is_set():  # healthy only once the master knows us
            await asyncio.sleep(0.05)
        await set_serving(health, [SERVICE])
        logger.info("storage node %s ready: grpc %s:%d%s, data %s, segment %d MiB, master %s",
                    config.node_id, config.host, port, " (tls)" if config.tls.enabled else "", segment.endpoint, config.segment_mb, config.master)
        await stop.wait()
    finally:
        logger.info("storage node %s stopping", config.node_id)
        await set_serving(health, [SERVICE], serving=False)
        heartbeats.cancel()
        await membership.unmount()
        await server.stop(grace=1)
        await channel.close()
        await segment.close()
        if metrics:
            metrics.close()


def main(argv: list[str] | None = None) -> None:
    setup_logging("kvnode")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
