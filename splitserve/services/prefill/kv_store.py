"""Prefill with the distributed KV store: reuse cached prefix blocks, publish new ones.

Lifecycle of one request:
1. Keys of the prompt's full blocks (chained block hashes, ``splitserve.kvstore.block_hash``).
2. Prefix lookup at the master: the leading run of complete blocks, each with a read lease.
3. Allocate that many engine blocks and read the objects straight into them over UCX. A block whose read
   fails, finishes after its lease, or fails its checksum ends the run: everything after it is computed.
4. ``engine.prefill`` with those blocks and ``num_computed_tokens`` set: only the rest of the prompt is
   computed (a prompt that is entirely cached still computes its last token, whose logits give the first
   token). The reused tokens are reported as ``cached_tokens``.
5. The response goes out at once. The new full blocks are written in the background (two-phase put;
   keys complete or being written elsewhere are skipped, so concurrent requests with one prefix produce
   one write). The write owns a share of the blocks it reads (``OwnedBlocks.share``: one extra engine
   reference, dropped when the write task ends however it ends), so freeing the request's blocks after
   the decode pull never races the write.

Store transfer mode (``transfer_mode="store"``) adds: the partial last block is written too (under a
per-transfer tail key), PutStart is awaited before responding (one master round trip, so the decode worker
finds the blocks PROCESSING rather than missing), and no blocks are held for a direct pull. If that
PutStart fails the request falls back to the direct pull.
"""

from __future__ import annotations

import asyncio
import logging

from splitserve.engine.async_engine import AsyncEngine, PrefillOutput
from splitserve.engine.owned_blocks import OwnedBlocks
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import ObjectAlreadyExists, PdError
from splitserve.kvstore.client import PutTicket
from splitserve.kvstore.kv_blocks import KVBlockStore, tail_key

logger = logging.getLogger(__name__)

#: store reads of a prefill with a deadline give up after this share of the time left, leaving the rest
#: to recompute what they could not read
READ_SHARE = 0.5


class PrefillStore:
    def __init__(self, engine: AsyncEngine, blocks: KVBlockStore, transfer_mode: str = "direct") -> None:
        self.engine = engine
        self.blocks = blocks
        self.transfer_mode = transfer_mode
        self.block_size = engine.layout.block_size
        self._writes: set[asyncio.Task] = set()
        self.cached_tokens = 0  # prefill tokens not computed thanks to the store
        self.cached_requests = 0

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      time_remaining: float | None = None, on_layers=None) -> PrefillOutput:
        """Steps 1-4: prefill reusing the longest cached prefix. Never fails because of the store: reads
        that fail or take longer than ``READ_SHARE`` of ``time_remaining`` (seconds left of the call's
        deadline) are recomputed. A request with ``prompt_logprobs`` reads nothing: every prompt position's logits
        are computed. ``on_layers``: as ``AsyncEngine.prefill``'s (KV push). Raises what ``AsyncEngine.prefill`` raises."""
        cached = None if params.prompt_logprobs is not None else await self._load_prefix(prompt, time_remaining)
        if cached is None:
            return await self.engine.prefill(request_id, prompt, params, on_layers=on_layers)
        async with cached:
            num_cached = min(len(cached) * self.block_size, len(prompt) - 1)
            self.cached_tokens += num_cached
            self.cached_requests += 1
            return await self.engine.prefill(request_id, prompt, params, cached=cached, num_cached_tokens=num_cached,
                                           on_layers=on_layers)

    async def _load_prefix(self, prompt: list[int], time_remaining: float | None) -> OwnedBlocks | None:
        """Engine blocks holding the prompt's longest readable cached prefix; None when nothing was read
        (or the prompt has one token: it cannot reuse anything)."""
        hits = await self.blocks.lookup_prefix(self.blocks.keys(prompt)) if len(prompt) > 1 else []
        if not hits:
            return None
        try:
            blocks = await self.engine.allocate_blocks(len(hits), wait=False)
        except PdError:  # not free right now: compute everything (the prefill itself waits for its blocks)
            return None
        async with blocks:  # freed if the read fails or is cancelled
            budget = None if time_remaining is None else READ_SHARE * time_remaining
            n = await self.blocks.load(hits, blocks.block_ids, budget)
            if n == 0:
                return None
            blocks.truncate(n)
            return blocks.move()

    async def publish(self, prompt: list[int], cached_tokens: int, blocks: OwnedBlocks, transfer_id: str) -> bool:
        """Step 5 for the prompt's KV in ``blocks`` (of which the first ``cached_tokens`` came from the store).
        Returns True when the KV goes through the store (store mode, PutStart done): the caller then frees
        ``blocks`` instead of holding them for a direct pull. The background write keeps its own share of
        the blocks. Raises BlocksReleased if ``blocks`` is no longer owned; store errors fall back to False."""
        keys = self.blocks.keys(prompt)
        first_new = min(-(-cached_tokens // self.block_size), len(keys))  # blocks that came from the store
        keys = keys[first_new:]
        via_store = self.transfer_mode == "store"
        tail_rows = len(prompt) % self.block_size if via_store else 0  # its used token rows only are written
        if tail_rows:
            keys.append(tail_key(transfer_id))  # the partial last block, blocks[len(full keys)]
        if not keys:
            return via_store
        write = blocks.share(first_new, first_new + len(keys))
        if not via_store:
            self._spawn(self.blocks.save(keys, write.block_ids), write)
            return False
        async with write:  # freed here unless the background write takes it
            try:
                tickets = await self.blocks.begin_save(keys, tail_rows)
            except PdError as exc:
                logger.warning("KV store unavailable for transfer %s, falling back to a direct pull: %s", transfer_id, exc)
                return False
            if not any(isinstance(t, (PutTicket, ObjectAlreadyExists)) for t in tickets):
                logger.warning("KV store took none of the blocks of %s (%s); falling back to a direct pull", transfer_id, tickets[0])
                return False
            if tail_key(transfer_id) in keys and not isinstance(tickets[-1], PutTicket):
                logger.warning("KV store refused the tail block of %s (%s); the decode worker recomputes it", transfer_id, tickets[-1])
            self._spawn(self.blocks.finish_save(keys, tickets, write.block_ids, tail_rows), write.move())
            return True

    def _spawn(self, save, blocks: OwnedBlocks) -> None:
        """Run a background write that owns ``blocks``: freed when the task ends, even if it never ran."""
        task = asyncio.get_running_loop().create_task(self._write(save))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        task.add_done_callback(lambda _: blocks.free())

    @staticmethod
    async def _write(save) -> None:
        try:
            await save
        except PdError as exc:  # e.g. the master went away between PutStart and PutEnd
            logger.warning("KV store write failed: %s", exc)
        except Exception:
            logger.exception("KV store write failed")

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Let background writes finish (up to ``timeout_s``), then cancel the rest."""
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=timeout_s)
        for t in list(self._writes):
            t.cancel()
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=2.0)

    def stats(self) -> dict[str, float]:
        counters = {f"kvstore_{k}": v for k, v in self.blocks.counters.items()}
        counters.update(
            kvstore_cached_tokens=self.cached_tokens,
            kvstore_cached_requests=self.cached_requests,
            kvstore_writes_in_flight=len(self._writes),
            kvstore_bytes_read=self.blocks.client.data.bytes_read,
            kvstore_bytes_written=self.blocks.client.data.bytes_written,
        )
        return counters
