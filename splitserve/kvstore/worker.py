"""Start a worker's KV store client (prefill and decode mains share this)."""

from __future__ import annotations

from splitserve.engine.async_engine import AsyncEngine
from splitserve.kvstore.client import KVStoreClient
from splitserve.kvstore.config import StoreClientConfig
from splitserve.kvstore.kv_blocks import KVBlockStore
from splitserve.rpc.tls import TlsConfig


async def start_store(config: StoreClientConfig, engine: AsyncEngine,
                      tls: TlsConfig | None = None) -> tuple[KVStoreClient | None, KVBlockStore | None]:
    """(client, KVBlockStore over the engine's cache), both None when the store is off. Must run inside the
    event loop that serves the worker (UCX binds to it). The master need not be up yet: calls to it fail
    softly (the worker computes without the store) until it is. ``tls``: the worker's TLS configuration, used
    for the master channel (the same one its gRPC server uses)."""
    if not config.enabled:
        return None, None
    client = KVStoreClient(config.master, rpc_timeout_s=config.rpc_timeout_s, io_timeout_s=config.io_timeout_s,
                           tls=tls)
    await client.start()
    return client, KVBlockStore(client, engine.kv_cache, engine.layout, config.salt)
