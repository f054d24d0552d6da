"""A prefill worker and a decode worker (``services/*/worker.py``) on two real engines in one process, joined
by the inproc KV transfer (no gRPC, no UCX), optionally with the in-memory KV store; plus the no-leak check."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.kvstore.kv_blocks import KVBlockStore
from splitserve.services.decode.kv_store import DecodeStore
from splitserve.services.decode.worker import DecodeJob, DecodeRun, DecodeWorker
from splitserve.services.prefill.kv_store import PrefillStore
from splitserve.services.prefill.worker import PrefillResult, PrefillWorker
from splitserve.transfer import create_receiver, create_sender
from tests.idle import wait_idle
from tests.memory_kvstore import MemoryStoreClient

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she "
         "saw a big red ball in the park.")


@dataclass
class Pair:
    p_engine: AsyncEngine
    d_engine: AsyncEngine
    prefill: PrefillWorker
    decode: DecodeWorker
    store: MemoryStoreClient | None

    async def prefill_then_decode(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
                                  ) -> tuple[PrefillResult, DecodeRun, list[int]]:
        """The disaggregated request: (prefill result, the decode run, all tokens from the first on)."""
        res = await self.prefill.prefill(rid, prompt, params)
        run = self.decode.decode(DecodeJob(rid, prompt, params, res.first_token_id, res.handle))
        return res, run, [res.first_token_id] + await tokens_of(run)


async def start_pair(lm, *, lease_s: float = 30.0, transfer_failure: str = "fallback", store_mode: str | None = None,
                     kv_cache_mb: int = 4, decode_prefix_caching: bool = False) -> Pair:
    """``store_mode``: None (no KV store), "direct" (prefix reuse; KV pulled from the prefill worker) or
    "store" (store transfer mode: the decode worker reads the prompt's KV from the store).
    ``decode_prefix_caching``: the decode engine keeps a prefix cache (delta transfers)."""
    p_engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=kv_cache_mb))
    d_engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=kv_cache_mb, enable_prefix_caching=decode_prefix_caching))
    await p_engine.start()
    await d_engine.start()
    sender = create_sender("inproc", p_engine.kv_cache, p_engine.layout)
    receiver = create_receiver("inproc", d_engine.kv_cache, d_engine.layout)
    await sender.start()
    await receiver.start()
    client = p_store = d_store = None
    if store_mode is not None:
        client = MemoryStoreClient()
        p_store = PrefillStore(p_engine, KVBlockStore(client, p_engine.kv_cache, p_engine.layout), store_mode)
        d_store = DecodeStore(d_engine, KVBlockStore(client, d_engine.kv_cache, d_engine.layout), wait_s=5.0)
    prefill = PrefillWorker(p_engine, sender, "inproc", lease_s, p_store)
    decode = DecodeWorker(d_engine, receiver, "inproc", 5.0, transfer_failure, d_store)
    return Pair(p_engine, d_engine, prefill, decode, client)


async def stop_pair(pair: Pair) -> None:
    pair.prefill.leases.release_all()
    if pair.prefill.store is not None:
        await pair.prefill.store.close()
        await pair.decode.store.close()
    await pair.prefill.sender.close()
    await pair.decode.receiver.close()
    await pair.p_engine.stop()
    await pair.d_engine.stop()


async def tokens_of(run) -> list[int]:
    return [t async for out in run for t in out.token_ids]


async def reference(engine: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    """The colocated run: ``engine.generate`` on one engine."""
    return await tokens_of(engine.generate(f"ref-{len(prompt)}", prompt, params))


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``predicate()`` (plain or async) until true; AssertionError naming ``what`` otherwise."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if loop.time() - t0 > timeout_s:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        await asyncio.sleep(0.01)


def dropped_owners(caplog) -> list[str]:
    """Warnings of OwnedBlocks garbage-collected while still owning blocks (freed by the safety net: a bug)."""
    records = caplog.get_records("setup") + caplog.get_records("call") + caplog.records  # (in a teardown: all phases)
    return [r.getMessage() for r in records if r.name == "splitserve.engine.owned_blocks"]


async def assert_no_leak(pair: Pair, caplog=None, timeout_s: float = 5.0) -> None:
    """Both workers idle by the one definition (tests/idle.py: every KV block free, nothing running, waiting,
    streaming, leased or being written to the store; background store writes may finish first); with
    ``caplog``, no owner was dropped without being freed."""

    async def read():
        return ({"prefill": {**await pair.p_engine.stats(), **pair.prefill.stats()},
                 "decode": {**await pair.d_engine.stats(), **pair.decode.stats()}}, None)

    await wait_idle(read, timeout_s)
    if caplog is not None:
        assert dropped_owners(caplog) == []
