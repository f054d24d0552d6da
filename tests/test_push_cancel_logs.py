"""Push mode: a client that cancels (or disconnects) is normal, so no worker logs a WARNING for it, whether the
cancel comes while the KV is pushed or while the decode streams; a real prefill failure still warns on decode.
(The router cancels both legs at once: the prefill worker's push failure may reach the decode worker before the
decode worker's own cancel does, so the push says it was cancelled.)"""

import asyncio
import logging
import uuid

import pytest

from splitserve.engine.faults import apply_engine_faults
from splitserve.engine.sampling import SamplingParams
from tests.inproc_cluster import InprocCluster

STEP_DELAY = {"PD_FAULT_STEP_DELAY_MS": "300"}  # a prefill step this long leaves time to cancel mid-push


def prompt_of(lm) -> list[int]:
    return lm.tokenizer.encode("Once upon a time there was a little girl who loved to play in the park. " * 3)[:40]


@pytest.fixture(params=[0, 1], ids=["per-layer", "whole-kv"])
async def push(lm, request):
    c = await InprocCluster(lm, kv_transfer_mode="push", push_layer_groups=request.param).start()
    yield c
    await c.stop()


async def generate(cluster: InprocCluster, prompt: list[int], got: list[int]) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    async for ev in cluster.backend.generate(uuid.uuid4().hex, prompt, params):
        got += ev.token_ids


async def until(predicate, what: str, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


def warnings_of(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("splitserve") and r.name != "splitserve.engine.faults"]


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancel_mid_push_logs_no_warning(push, lm, caplog):
    caplog.set_level(logging.DEBUG, logger="splitserve")
    apply_engine_faults(push.prefill[0].engine, STEP_DELAY)
    prefill, decode = push.prefill[0].servicer.worker, push.decode[0].servicer.worker
    task = asyncio.create_task(generate(push, prompt_of(lm), []))
    await until(lambda: prefill.in_flight == 1 and decode.streams_open == 1 and len(prefill.sender.push_table) == 1,
                "a push in flight")
    await cancel(task)
    await push.wait_idle(timeout_s=5.0)
    assert decode.num_pushes == 0  # it was cancelled mid-push, not after it
    assert warnings_of(caplog) == []


async def test_a_cancel_mid_decode_logs_no_warning(push, lm, caplog):
    caplog.set_level(logging.DEBUG, logger="splitserve")
    apply_engine_faults(push.decode[0].engine, STEP_DELAY)
    got: list[int] = []
    task = asyncio.create_task(generate(push, prompt_of(lm), got))
    await until(lambda: len(got) >= 2, "the stream to start")
    await cancel(task)
    await push.wait_idle(timeout_s=5.0)
    assert push.decode[0].servicer.worker.num_pushes == 1
    assert warnings_of(caplog) == []


async def test_a_failed_prefill_still_warns_on_decode(push, lm, caplog, monkeypatch):
    engine = push.prefill[0].engine

    async def failing_prefill(*args, **kwargs):
        await asyncio.sleep(0.2)  # the decode worker subscribes first
        raise RuntimeError("prefill exploded")

    monkeypatch.setattr(engine, "prefill", failing_prefill)
    got: list[int] = []
    await asyncio.wait_for(generate(push, prompt_of(lm), got), 30)  # the router prefills on the decode worker
    assert len(got) == 64
    await push.wait_idle(timeout_s=5.0)
    assert any("decode" in w and "prefill exploded" in w for w in warnings_of(caplog)), warnings_of(caplog)
