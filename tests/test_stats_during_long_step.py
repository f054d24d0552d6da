"""A worker busy with a long engine step stays in the router's rotation.

The router polls each worker's health and GetStats with a deadline (``poll_timeout_s``) and takes a worker out of
rotation after ``miss_limit`` missed polls. GetStats must therefore answer while a step runs: here every step of a
real prefill worker (in-process engine and gRPC server) is slowed to 2.5 s (``PD_FAULT_STEP_DELAY_MS``), longer than
the 1 s poll deadline, and the registry must keep the worker up through the step. Before GetStats read its counters
off the engine thread, both polls ended DEADLINE_EXCEEDED and the worker went down.
"""

import asyncio
import time

import pytest
from pd.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.faults import apply_engine_faults
from splitserve.launcher import free_port
from splitserve.rpc.server import bind, create_server
from splitserve.services.prefill.server import PrefillServicer
from splitserve.services.router.registry import PREFILL, WorkerRegistry
from splitserve.transfer import create_sender

STEP_MS = 2500  # one engine step; longer than the poll deadline below
POLL_TIMEOUT_S = 1.0


@pytest.fixture
async def slow_prefill(lm):
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    apply_engine_faults(engine, {"PD_FAULT_STEP_DELAY_MS": str(STEP_MS)})
    await engine.start()
    sender = create_sender("inproc", engine.kv_cache, engine.layout)
    await sender.start()
    server, _ = create_server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(engine, sender, "inproc", lease_s=0.3), server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    yield engine, f"127.0.0.1:{port}"
    await server.stop(0)
    await sender.close()
    await engine.stop()


async def test_a_worker_in_a_long_step_answers_getstats_and_stays_in_rotation(slow_prefill, lm):
    engine, address = slow_prefill
    registry = WorkerRegistry([address], [f"127.0.0.1:{free_port()}"], poll_timeout_s=POLL_TIMEOUT_S, miss_limit=2)
    worker = registry.workers[PREFILL][0]
    try:
        assert await registry.poll_once(worker) and worker.up  # idle: the layout is fetched too
        prompt = lm.tokenizer.encode("Once upon a time, there was a little girl")
        stub = prefill_pb2_grpc.PrefillServiceStub(worker.channel)
        call = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
            request_id="long-step", prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))))
        while (await engine.stats(wait_for_step=False))["requests_running"] == 0:  # the step has begun
            assert not call.done(), (call.exception(), await engine.stats(wait_for_step=False))
            await asyncio.sleep(0.01)
        step_started = time.monotonic()
        for _ in range(2):  # miss_limit polls inside one step: each must answer in time
            assert await registry.poll_once(worker), worker.last_error
            assert worker.up and worker.stats["requests_running"] == 1
        assert time.monotonic() - step_started < STEP_MS / 1000, "the polls outlasted the step: nothing was tested"
        resp = await call
        assert resp.kv_handle.num_tokens == len(prompt)
        assert await registry.poll_once(worker) and worker.up
    finally:
        await registry.close()

