"""Workers whose role can change (`splitserve worker`), in-process for fast tests: one engine, the inproc KV
transport (a sender and a receiver), PrefillService + DecodeService + RoleService on a real gRPC server."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from pd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, role_pb2, role_pb2_grpc

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.faults import apply_engine_faults
from splitserve.rpc.server import bind, channel, create_server
from splitserve.services.worker.roles import RoleState
from splitserve.services.worker.server import RoleDecodeServicer, RolePrefillServicer, RoleServicer
from splitserve.transfer import create_receiver, create_sender

R = common_pb2


@dataclass
class RoleWorker:
    roles: RoleState
    engine: AsyncEngine
    prefill: RolePrefillServicer
    decode: RoleDecodeServicer
    server: grpc.aio.Server
    address: str
    closers: list = field(default_factory=list)

    async def stats(self) -> dict[str, float]:
        return dict((await self.decode.GetStats(R.GetStatsRequest(), None)).counters)

    async def stop(self) -> None:
        await self.server.stop(0)
        for close in self.closers:
            await close()


async def start_role_worker(lm, role: str, step_delay_ms: int = 0, grace_s: float = 0.0) -> RoleWorker:
    """`splitserve worker` in-process (inproc KV transport): one engine, a sender and a receiver, three services."""
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    if step_delay_ms:
        apply_engine_faults(engine, {"PD_FAULT_STEP_DELAY_MS": str(step_delay_ms)})
    await engine.start()
    sender = create_sender("inproc", engine.kv_cache, engine.layout)
    await sender.start()
    receiver = create_receiver("inproc", engine.kv_cache, engine.layout)
    await receiver.start()
    roles = RoleState(role, grace_s)
    prefill = RolePrefillServicer(roles, engine, sender, "inproc", 30.0)
    decode = RoleDecodeServicer(roles, engine, receiver, "inproc", 5.0)
    prefill.peer, decode.peer = decode, prefill
    server, _ = create_server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, server)
    role_pb2_grpc.add_RoleServiceServicer_to_server(RoleServicer(roles), server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    return RoleWorker(roles, engine, prefill, decode, server, f"127.0.0.1:{port}", [sender.close, receiver.close, engine.stop])


async def set_role(address: str, role: int, drain_timeout_ms: int = 0) -> role_pb2.SetRoleResponse:
    async with channel(address) as ch:
        return await role_pb2_grpc.RoleServiceStub(ch).SetRole(
            role_pb2.SetRoleRequest(role=role, drain_timeout_ms=drain_timeout_ms, reason="test"), timeout=30)
