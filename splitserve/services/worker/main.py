"""Worker process whose role can change in place (`splitserve worker --role prefill|decode|both`): one engine and one
KV cache, a KV sender (for the KV it prefills) and a KV receiver (for the KV it decodes), and on one gRPC port
PrefillService, DecodeService and RoleService (:mod:`.server`). SIGTERM drains both kinds of work."""

from __future__ import annotations

import asyncio
import logging

from pd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, role_pb2, role_pb2_grpc

from splitserve.kvstore.worker import start_store
from splitserve.logs import setup_logging
from splitserve.rpc.server import bind, create_server
from splitserve.rpc.shutdown import Drain
from splitserve.services.decode.kv_store import DecodeStore
from splitserve.services.prefill.kv_store import PrefillStore
from splitserve.services.worker.config import RoleWorkerConfig, parse
from splitserve.services.worker.roles import DECODE, PREFILL, RoleState
from splitserve.services.worker.server import RoleDecodeServicer, RolePrefillServicer, RoleServicer
from splitserve.services.worker_process import WorkerServer, start_engine
from splitserve.telemetry.exposition import start_worker_metrics
from splitserve.telemetry.push_metrics import register_push_stats
from splitserve.telemetry.stats_collector import register_stats
from splitserve.telemetry.tracing import setup_tracing
from splitserve.transfer import create_receiver, create_sender
from splitserve.transfer.faults import sender_fault_options

logger = logging.getLogger("splitserve.worker")
PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
ROLE_SERVICE = role_pb2.DESCRIPTOR.services_by_name["RoleService"].full_name


async def serve(config: RoleWorkerConfig) -> None:
    lm, engine = await start_engine(config)
    sender = create_sender(config.transport, engine.kv_cache, engine.layout, host=config.data_host, port=config.data_port,
                           **sender_fault_options())
    await sender.start()
    receiver = create_receiver(config.transport, engine.kv_cache, engine.layout, verify_checksum=config.kv_checksum)
    await receiver.start()
    store_client, blocks = await start_store(config.store, engine, config.tls)
    prefill_store = PrefillStore(engine, blocks, config.store.transfer_mode) if blocks is not None else None
    decode_store = DecodeStore(engine, blocks, config.store.wait_s) if blocks is not None else None
    roles = RoleState(config.role, config.role_switch_grace_s)
    prefill = RolePrefillServicer(roles, engine, sender, config.transport, config.kv_lease_s, prefill_store,
                                  advertise=config.data_advertise)
    decode = RoleDecodeServicer(roles, engine, receiver, config.transport, config.kv_transfer_timeout_s,
                                config.kv_transfer_failure, store=decode_store,
                                push_layer_groups=config.kv_push_layer_groups)
    prefill.peer, decode.peer = decode, prefill

    drain = Drain()  # SIGTERM: both kinds of work are refused and drained
    server, health = create_server(drain=drain, work_methods=[f"/{PREFILL_SERVICE}/Prefill", f"/{DECODE_SERVICE}/Decode"])
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, server)
    role_pb2_grpc.add_RoleServiceServicer_to_server(RoleServicer(roles), server)
    port = bind(server, config.host, config.port, config.tls)
    await server.start()
    gauges = {
        "splitserve:kv_leases_held": ("KV transfers held for a decode worker to pull.", lambda: len(prefill.leases)),
        "splitserve:worker_takes_prefill": ("1 while the worker's role takes new prefill calls, else 0.",
                                            lambda: float(roles.takes(PREFILL))),
        "splitserve:worker_takes_decode": ("1 while the worker's role takes new decode streams, else 0.",
                                           lambda: float(roles.takes(DECODE))),
        "splitserve:worker_role_switches": ("Role changes since start.", lambda: float(roles.switches)),
    }
    metrics = start_worker_metrics("elastic", engine, config.host, config.metrics_port, gauges=gauges)
    register_push_stats(prefill.worker.stats, decode.worker.stats)  # both roles' push counters
    if prefill_store is not None:
        register_stats("kv_store_client", prefill_store.stats, {"kvstore_writes_in_flight"}, doc="KV store client (prefill)")
    worker = WorkerServer("elastic", PREFILL_SERVICE, server, health, drain, port, metrics, engine,
                          extra_services=(DECODE_SERVICE, ROLE_SERVICE))
    logger.info(
        "worker ready (role %s): grpc %s:%d%s, kv data %s (%s), model %s, %d KV blocks of %d tokens, kv store %s, metrics %s",
        roles.role, config.host, port, " (tls)" if config.tls.enabled else "", prefill.endpoint, config.transport,
        lm.model_id, engine.num_blocks, config.engine.block_size, config.store.master or "off",
        metrics.url if metrics else "off",
    )
    closers = [prefill.leases.release_all,
               *([prefill_store.close, decode_store.close, store_client.close] if prefill_store is not None else []),
               sender.close, receiver.close, engine.stop]
    await worker.serve(config, busy=lambda: len(prefill.leases) > 0, closers=closers)


def main(argv: list[str] | None = None) -> None:
    setup_logging("worker")
    setup_tracing("splitserve-worker")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
