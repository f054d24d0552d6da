"""Decode worker process: engine + KV receiver (data plane) + gRPC DecodeService (control plane)."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import decode_pb2, decode_pb2_grpc

from splitserve.services.decode.config import DecodeConfig, parse
from splitserve.services.decode.kv_store import DecodeStore
from splitserve.services.decode.server import DecodeServicer
from splitserve.engine.async_engine import AsyncEngine, set_torch_threads
from splitserve.kvstore.worker import start_store
from splitserve.logs import setup_logging
from splitserve.model import load_model
from splitserve.rpc.server import bind, create_server, set_serving, stop_event_on_signals
from splitserve.telemetry.exposition import start_worker_metrics
from splitserve.telemetry.tracing import setup_tracing
from splitserve.transfer import create_receiver

logger = logging.getLogger("splitserve.decode")
SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


async def serve(config: DecodeConfig) -> None:
    set_torch_threads(config.torch_threads)
    lm = load_model(config.model)
    engine = AsyncEngine(lm, config.engine)
    await engine.start()
    receiver = create_receiver(config.transport, engine.kv_cache, engine.layout, verify_checksum=config.kv_checksum)
    await receiver.start()
    store_client, store = await start_store(config.store, engine, config.tls)
    if store is not None:
        store = DecodeStore(engine, store, config.store.wait_s)
    server, health = create_server()
    servicer = DecodeServicer(
        engine, receiver, config.transport, config.kv_transfer_timeout_s, config.kv_transfer_failure, store=store
    )
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    metrics = start_worker_metrics("decode", engine, config.host, config.metrics_port)
    await set_serving(health, [SERVICE])
    logger.info(
        "decode worker ready: grpc %s:%d%s, kv transport %s (on failure: %s, checksum %s), model %s, %d KV blocks of %d tokens, "
        "kv store %s, metrics %s",
        config.host, port, " (tls)" if config.tls.enabled else "", config.transport, config.kv_transfer_failure,
        "on" if config.kv_checksum else "off", lm.model_id, engine.num_blocks, config.engine.block_size,
        config.store.master or "off", metrics.url if metrics else "off",
    )
    stop = stop_event_on_signals()
    try:
        await stop.wait()
    finally:
        logger.info("decode worker stopping")
        await set_serving(health, [SERVICE], serving=False)
        await server.stop(grace=2)
        if store is not None:
            await store.close()
            await store_client.close()
        if metrics:
            metrics.close()
        await receiver.close()
        await engine.stop()


def main(argv: list[str] | None = None) -> None:
    setup_logging("decode")
    setup_tracing("splitserve-decode")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
