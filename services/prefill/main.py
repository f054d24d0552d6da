"""Prefill worker process: engine + KV sender (data plane) + gRPC PrefillService (control plane)."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import prefill_pb2, prefill_pb2_grpc

from splitserve.services.prefill.config import PrefillConfig, parse
from splitserve.services.prefill.kv_store import PrefillStore
from splitserve.services.prefill.server import PrefillServicer
from splitserve.engine.async_engine import AsyncEngine, set_torch_threads
from splitserve.kvstore.worker import start_store
from splitserve.logs import setup_logging
from splitserve.model import load_model
from splitserve.rpc.server import bind, create_server, set_serving, stop_event_on_signals
from splitserve.telemetry.exposition import start_worker_metrics
from splitserve.telemetry.stats_collector import register_stats
from splitserve.telemetry.tracing import setup_tracing
from splitserve.transfer import create_sender
from splitserve.transfer.faults import sender_fault_options

logger = logging.getLogger("splitserve.prefill")
SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


async def serve(config: PrefillConfig) -> None:
    set_torch_threads(config.torch_threads)
    lm = load_model(config.model)
    engine = AsyncEngine(lm, config.engine)
    await engine.start()
    sender = create_sender(config.transport, engine.kv_cache, engine.layout, host=config.data_host, port=config.data_port,
                           **sender_fault_options())
    await sender.start()
    store_client, store = await start_store(config.store, engine, config.tls)
    if store is not None:
        store = PrefillStore(engine, store, config.store.transfer_mode)
    server, health = create_server()
    servicer = PrefillServicer(engine, sender, config.transport, config.kv_lease_s, store, advertise=config.data_advertise)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    held = {"splitserve:kv_leases_held": ("KV transfers held for a decode worker to pull.", lambda: len(servicer.leases))}
    metrics = start_worker_metrics("prefill", engine, config.host, config.metrics_port, gauges=held)
    if store is not None:  # prefix lookups (hits/misses), cached tokens, store bytes: the KV store client's side
        register_stats("kv_store_client", store.stats, {"kvstore_writes_in_flight"}, doc="KV store client (prefill)")
    await set_serving(health, [SERVICE])
    logger.info(
        "prefill worker ready: grpc %s:%d%s, kv data %s (%s), model %s, %d KV blocks of %d tokens, kv store %s (%s transfer), metrics %s",
        config.host, port, " (tls)" if config.tls.enabled else "", servicer.endpoint, config.transport, lm.model_id,
        engine.num_blocks, config.engine.block_size,
        config.store.master or "off", config.store.transfer_mode, metrics.url if metrics else "off",
    )
    stop = stop_event_on_signals()
    try:
        await stop.wait()
    finally:
        logger.info("prefill worker stopping")
        await set_serving(health, [SERVICE], serving=False)
        await server.stop(grace=2)
        if metrics:
            metrics.close()
        servicer.leases.release_all()
        if store is not None:
            await store.close()
            await store_client.close()
        await sender.close()
        await engine.stop()


def main(argv: list[str] | None = None) -> None:
    setup_logging("prefill")
    setup_tracing("splitserve-prefill")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
