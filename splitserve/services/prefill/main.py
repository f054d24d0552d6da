"""Prefill worker process: engine + KV sender (data plane) + gRPC PrefillService (control plane)."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import prefill_pb2, prefill_pb2_grpc

from splitserve.services.prefill.config import PrefillConfig, parse
from splitserve.services.prefill.kv_store import PrefillStore
from splitserve.services.prefill.server import PrefillServicer
from splitserve.services.worker_process import WorkerServer, start_engine
from splitserve.kvstore.worker import start_store
from splitserve.logs import setup_logging
from splitserve.telemetry.push_metrics import register_push_stats
from splitserve.telemetry.stats_collector import register_stats
from splitserve.telemetry.tracing import setup_tracing
from splitserve.transfer import create_sender
from splitserve.transfer.faults import sender_fault_options

logger = logging.getLogger("splitserve.prefill")
SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


async def serve(config: PrefillConfig) -> None:
    lm, engine = await start_engine(config)
    sender = create_sender(config.transport, engine.kv_cache, engine.layout, host=config.data_host, port=config.data_port,
                           **sender_fault_options())
    await sender.start()
    store_client, store = await start_store(config.store, engine, config.tls)
    if store is not None:
        store = PrefillStore(engine, store, config.store.transfer_mode)
    servicer = PrefillServicer(engine, sender, config.transport, config.kv_lease_s, store, advertise=config.data_advertise)
    held = {"splitserve:kv_leases_held": ("KV transfers held for a decode worker to pull.", lambda: len(servicer.leases))}
    worker = await WorkerServer.start("prefill", SERVICE, "Prefill", prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                                      servicer, engine, config, gauges=held)
    register_push_stats(servicer.worker.stats)  # splitserve:kv_pushes_total, kv_push_fallbacks_total, kv_pushes_pending
    if store is not None:  # prefix lookups (hits/misses), cached tokens, store bytes: the KV store client's side
        register_stats("kv_store_client", store.stats, {"kvstore_writes_in_flight"}, doc="KV store client (prefill)")
    logger.info(
        "prefill worker ready: grpc %s:%d%s, kv data %s (%s), model %s, %d KV blocks of %d tokens, kv store %s (%s transfer), metrics %s",
        config.host, worker.port, " (tls)" if config.tls.enabled else "", servicer.endpoint, config.transport, lm.model_id,
        engine.num_blocks, config.engine.block_size,
        config.store.master or "off", config.store.transfer_mode, worker.metrics.url if worker.metrics else "off",
    )
    # draining also waits for the KV held for decode workers to be pulled (or released, or its lease to end)
    closers = [servicer.leases.release_all, *([store.close, store_client.close] if store is not None else []),
               sender.close, engine.stop]
    await worker.serve(config, busy=lambda: len(servicer.leases) > 0, closers=closers)


def main(argv: list[str] | None = None) -> None:
    setup_logging("prefill")
    setup_tracing("splitserve-prefill")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
