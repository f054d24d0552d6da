"""Decode with the distributed KV store (store transfer mode): read the prompt's KV from the store.

Lifecycle of one request whose KV handle says ``via_store``:
1. Keys of the prompt's full blocks (the same chained block hashes the prefill worker used) plus, when
   the prompt ends in a partial block, the handle's ``store_tail_key``.
2. Wait (up to ``wait_s``) until the leading objects are complete -- the prefill worker answers before its
   background write finished -- then read the leading run straight into the request's KV blocks over UCX
   (lease and checksum verified).
3. Whatever could not be read (missing, evicted, lease expired, node down) is recomputed by the first
   decode step, together with the first token: the output is the same either way.
4. The tail object is removed once read (it belongs to this request alone; if removal fails, LRU
   eviction reclaims it).
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.errors import PdError
from splitserve.kvstore.kv_blocks import KVBlockStore
from splitserve.transfer.handle import KVHandle

logger = logging.getLogger(__name__)


class DecodeStore:
    def __init__(self, engine: AsyncEngine, blocks: KVBlockStore, wait_s: float) -> None:
        self.engine = engine
        self.blocks = blocks
        self.wait_s = wait_s
        self.block_size = engine.layout.block_size
        self.loaded_tokens = 0  # prompt tokens whose KV came from the store
        self.recomputed_tokens = 0  # prompt tokens the decode worker had to compute itself
        self._cleanups: set[asyncio.Task] = set()

    async def load_prompt(self, handle: KVHandle, prompt: list[int], blocks: OwnedBlocks,
                          timeout_s: float | None = None, skip_blocks: int = 0) -> int:
        """Fill ``blocks`` (covering the prompt; they stay with the caller) from the store, waiting and reading
        for at most ``timeout_s`` in all (None: ``wait_s`` plus the reads); returns how many leading prompt
        tokens now have their K/V there (the rest is for the engine to compute). The first ``skip_blocks`` blocks
        already hold their K/V (the decode worker's prefix cache): only the blocks after them are read."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        keys = self.blocks.keys(prompt)[skip_blocks:]
        tail = handle.store_tail_key if len(prompt) % self.block_size else ""
        if tail:
            keys.append(tail)
        hits = await self.blocks.wait_prefix(keys, self.wait_s if timeout_s is None else min(self.wait_s, timeout_s))
        remaining = None if deadline is None else max(0.0, deadline - loop.time())
        dst = blocks.block_ids[skip_blocks : skip_blocks + len(hits)]
        tail_rows = len(prompt) % self.block_size if tail and len(hits) == len(keys) else 0  # packed used rows
        n = await self.blocks.load(hits, dst, remaining, tail_rows) if hits else 0
        if tail:  # best effort; one the prefill worker is still writing is left to eviction
            self._spawn_remove(tail)
        computed = min((skip_blocks + n) * self.block_size, len(prompt))
        self.loaded_tokens += computed - min(skip_blocks * self.block_size, len(prompt))
        self.recomputed_tokens += len(prompt) - computed
        if computed < len(prompt):
            logger.info("request %s: %d of %d prompt tokens read from the KV store, the rest is recomputed",
                        handle.request_id, computed, len(prompt))
        return computed

    def _spawn_remove(self, key: str) -> None:
        async def remove() -> None:
            try:
                await self.blocks.client.remove(key, ignore_lease=True)
            except PdError as exc:
                logger.debug("removing %s: %s", key, exc)

        task = asyncio.get_running_loop().create_task(remove())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def close(self) -> None:
        if self._cleanups:
            await asyncio.wait(list(self._cleanups), timeout=2.0)

    def stats(self) -> dict[str, float]:
        counters = {f"kvstore_{k}": v for k, v in self.blocks.counters.items()}
        counters.update(kvstore_loaded_tokens=self.loaded_tokens, kvstore_recomputed_tokens=self.recomputed_tokens,
                        kvstore_bytes_read=self.blocks.client.data.bytes_read)
        return counters
