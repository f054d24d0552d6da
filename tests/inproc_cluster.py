"""A whole P/D deployment in one process for fast tests: real engines, real gRPC servers (optionally TLS),
the inproc KV transport, the router's RoutedBackend (every worker in rotation, no polling), RouterService and
HTTP app."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import httpx
from pd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2_grpc

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.frontend.grpc_api import RouterServicer
from splitserve.frontend.http_app import build_app
from splitserve.launcher import free_port
from splitserve.rpc.server import bind, channel, create_server
from splitserve.rpc.tls import TlsConfig
from splitserve.served_model import ServedModel
from splitserve.services.decode.server import DecodeServicer
from splitserve.services.prefill.server import PrefillServicer
from splitserve.services.router.backend import RoutedBackend
from splitserve.services.router.registry import WorkerRegistry
from splitserve.transfer import create_receiver, create_sender
from tests.idle import wait_idle


def static_backend(prefill: list[str], decode: list[str], tls: TlsConfig | None = None, **kw) -> RoutedBackend:
    """A RoutedBackend (round robin) over fixed workers that are all in rotation from the start and never polled:
    requests reach dead ones (listed first) and fail over deterministically. ``kw`` goes to RoutedBackend."""
    registry = WorkerRegistry(prefill, decode, tls=tls)
    for w in registry.all():
        w.up = True
    return RoutedBackend(registry, **kw)


@dataclass
class Worker:
    servicer: object
    engine: AsyncEngine
    server: grpc.aio.Server
    address: str
    closers: list = field(default_factory=list)


class InprocCluster:
    def __init__(
        self, lm, *, num_prefill: int = 1, num_decode: int = 1, dead_prefill: int = 0, dead_decode: int = 0,
        tls: TlsConfig | None = None, api_key: str | None = None, lease_s: float = 30.0, transfer_timeout_s: float = 2.0,
        transfer_failure: str = "fallback", verify_checksum: bool = False, corrupt: bool = False,
        advertise: str | None = None, request_timeout_s: float | None = None, prefill_timeout_s: float = 60.0,
        local_prefill_fallback: bool = True, kv_cache_mb: int = 4, kv_transfer_mode: str = "direct",
        push_layer_groups: int = 0, push_timeout_s: float = 60.0,
    ) -> None:
        self.lm = lm
        self.tls = tls
        self.api_key = api_key
        self._opts = dict(num_prefill=num_prefill, num_decode=num_decode, dead_prefill=dead_prefill, dead_decode=dead_decode,
                          lease_s=lease_s, transfer_timeout_s=transfer_timeout_s, transfer_failure=transfer_failure,
                          verify_checksum=verify_checksum, corrupt=corrupt, advertise=advertise, kv_cache_mb=kv_cache_mb,
                          push_layer_groups=push_layer_groups, push_timeout_s=push_timeout_s)
        self.kv_transfer_mode = kv_transfer_mode
        self.request_timeout_s = request_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.local_prefill_fallback = local_prefill_fallback
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []

    async def _server(self, add, servicer) -> tuple[grpc.aio.Server, str]:
        server, _ = create_server()
        add(servicer, server)
        port = bind(server, "127.0.0.1", 0, self.tls)
        await server.start()
        return server, f"127.0.0.1:{port}"

    async def start(self) -> "InprocCluster":
        o = self._opts
        for _ in range(o["num_prefill"]):
            engine = AsyncEngine(self.lm, EngineConfig(kv_cache_mb=o["kv_cache_mb"]))
            await engine.start()
            sender = create_sender("inproc", engine.kv_cache, engine.layout, corrupt_sends=o["corrupt"])
            await sender.start()
            servicer = PrefillServicer(engine, sender, "inproc", o["lease_s"], advertise=o["advertise"])
            server, address = await self._server(prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer)
            self.prefill.append(Worker(servicer, engine, server, address, [sender.close, engine.stop]))
        for _ in range(o["num_decode"]):
            engine = AsyncEngine(self.lm, EngineConfig(kv_cache_mb=o["kv_cache_mb"]))
            await engine.start()
            receiver = create_receiver("inproc", engine.kv_cache, engine.layout, verify_checksum=o["verify_checksum"])
            await receiver.start()
            servicer = DecodeServicer(engine, receiver, "inproc", o["transfer_timeout_s"], o["transfer_failure"],
                                      push_timeout_s=o["push_timeout_s"], push_layer_groups=o["push_layer_groups"])
            server, address = await self._server(decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer)
            self.decode.append(Worker(servicer, engine, server, address, [receiver.close, engine.stop]))
        dead_p = [f"127.0.0.1:{free_port()}" for _ in range(o["dead_prefill"])]
        dead_d = [f"127.0.0.1:{free_port()}" for _ in range(o["dead_decode"])]
        self.backend = static_backend(
            dead_p + [w.address for w in self.prefill], dead_d + [w.address for w in self.decode], tls=self.tls,
            prefill_timeout_s=self.prefill_timeout_s, local_prefill_fallback=self.local_prefill_fallback,
            kv_transfer_mode=self.kv_transfer_mode,
        )
        for w, live in zip(self.backend.registry.workers["prefill"][len(dead_p):], self.prefill):
            w.kv_endpoint = live.servicer.endpoint  # what the registry's poll reads from GetKVLayout
        self.router_servicer = RouterServicer(self.backend, self.lm.tokenizer, self.lm.max_model_len)
        self.router_server, _ = create_server(api_key=self.api_key, protected_services=["pd.v1.RouterService"])
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.router_servicer, self.router_server)
        self.router_address = f"127.0.0.1:{bind(self.router_server, '127.0.0.1', 0, self.tls)}"
        await self.router_server.start()
        served = ServedModel("tiny", self.lm.tokenizer, self.lm.max_model_len)
        self.app = build_app(served, self.backend, api_key=self.api_key, request_timeout_s=self.request_timeout_s)
        return self

    def http(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://router", timeout=30, **kw)

    def router_stub(self, tls: TlsConfig | None = None) -> tuple[grpc.aio.Channel, router_pb2_grpc.RouterServiceStub]:
        ch = channel(self.router_address, self.tls if tls is None else tls)
        return ch, router_pb2_grpc.RouterServiceStub(ch)

    async def worker_stats(self) -> list[dict]:
        out = []
        for w in self.prefill + self.decode:
            out.append(dict((await w.servicer.GetStats(common_pb2.GetStatsRequest(), None)).counters))
        return out

    async def read_stats(self) -> tuple[dict[str, dict], dict]:
        """Counters of every worker (``prefill-<i>``, ``decode-<i>``) and of the router (tests/idle.py)."""
        stats = await self.worker_stats()
        names = [f"prefill-{i}" for i in range(len(self.prefill))] + [f"decode-{i}" for i in range(len(self.decode))]
        return dict(zip(names, stats)), {**self.backend.stats(), "grpc_streams_open": self.router_servicer.streams_open}

    async def wait_idle(self, timeout_s: float = 2.0) -> float:
        """Seconds until every worker and the router are idle (tests/idle.py); AssertionError naming what is not."""
        return await wait_idle(self.read_stats, timeout_s, poll_s=0.02)

    async def stop(self) -> None:
        await self.router_server.stop(0)
        await self.backend.close()
        for w in self.prefill + self.decode:
            await w.server.stop(0)
            for close in w.closers:
                await close()
