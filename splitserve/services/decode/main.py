"""Decode worker process: engine + KV receiver (data plane) + gRPC DecodeService (control plane)."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import decode_pb2, decode_pb2_grpc

from splitserve.services.decode.config import DecodeConfig, parse
from splitserve.services.decode.kv_store import DecodeStore
from splitserve.services.decode.server import DecodeServicer
from splitserve.services.worker_process import WorkerServer, start_engine
from splitserve.kvstore.worker import start_store
from splitserve.logs import setup_logging
from splitserve.telemetry.push_metrics import register_push_stats
from splitserve.telemetry.tracing import setup_tracing
from splitserve.transfer import create_receiver

logger = logging.getLogger("splitserve.decode")
SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


async def serve(config: DecodeConfig) -> None:
    lm, engine = await start_engine(config)
    receiver = create_receiver(config.transport, engine.kv_cache, engine.layout, verify_checksum=config.kv_checksum)
    await receiver.start()
    store_client, store = await start_store(config.store, engine, config.tls)
    if store is not None:
        store = DecodeStore(engine, store, config.store.wait_s)
    servicer = DecodeServicer(
        engine, receiver, config.transport, config.kv_transfer_timeout_s, config.kv_transfer_failure, store=store,
        push_timeout_s=config.kv_push_timeout_s, push_layer_groups=config.kv_push_layer_groups,
    )
    worker = await WorkerServer.start("decode", SERVICE, "Decode", decode_pb2_grpc.add_DecodeServiceServicer_to_server,
                                      servicer, engine, config)
    register_push_stats(servicer.worker.stats)  # splitserve:kv_pushes_received_total
    logger.info(
        "decode worker ready: grpc %s:%d%s, kv transport %s (on failure: %s, checksum %s), model %s, %d KV blocks of %d tokens, "
        "kv store %s, metrics %s",
        config.host, worker.port, " (tls)" if config.tls.enabled else "", config.transport, config.kv_transfer_failure,
        "on" if config.kv_checksum else "off", lm.model_id, engine.num_blocks, config.engine.block_size,
        config.store.master or "off", worker.metrics.url if worker.metrics else "off",
    )
    closers = [*([store.close, store_client.close] if store is not None else []), receiver.close, engine.stop]
    await worker.serve(config, closers=closers)


def main(argv: list[str] | None = None) -> None:
    setup_logging("decode")
    setup_tracing("splitserve-decode")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
