"""Decode migration in the router (fake prefill and decode workers over in-process gRPC): a decode stream that fails
mid-stream continues on another decode worker with ``resume_output_token_ids`` = the tokens already sent, each
unfinished choice as its own continuation (choice i's sampling, its index kept), no duplicate and no gap; bounded
moves, the deadline, and ``decode_migrations=0`` (the old error)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import DeadlineExceeded, WorkerUnavailable
from splitserve.frontend.backend import TokenEvent
from splitserve.rpc.convert import sampling_from_proto
from splitserve.rpc.server import bind, create_server
from splitserve.services.router.disaggregation import DisaggregationPolicy
from splitserve.services.router.migration import choice_sampling, continuation_id
from tests.inproc_cluster import static_backend

STOP, LENGTH, NONE = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_UNSPECIFIED
PROMPT = [1, 40, 41, 42]
HANDLE = common_pb2.KVHandle(request_id="r", transfer_id="t1", endpoint="127.0.0.1:9", block_ids=[0], num_tokens=4)


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, response: prefill_pb2.PrefillResponse) -> None:
        self.response = response

    async def Prefill(self, request, context):
        return self.response

    async def ReleaseKV(self, request, context):
        return prefill_pb2.ReleaseKVResponse(released=True)


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Streams ``scripts[k]`` to its k-th call: (index, token, finish) messages, then ``"die"`` (UNAVAILABLE),
    ``"hang"`` (silent until cancelled) or the end of the stream. Fakes given one ``requests`` list share the calls
    (and the script of each). ``by_id``: the script of each request_id instead."""

    def __init__(self, *scripts: list, requests: list | None = None, by_id: dict[str, list] | None = None) -> None:
        self.scripts = list(scripts)
        self.by_id = by_id
        self.requests: list[decode_pb2.DecodeRequest] = [] if requests is None else requests
        self.time_remaining: list[float | None] = []

    async def Decode(self, request, context):
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        script = self.scripts[len(self.requests) - 1] if self.by_id is None else self.by_id[request.request_id]
        for step in script:
            if step == "die":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
            if step == "hang":
                await asyncio.sleep(3600)
            index, token, finish = step
            yield decode_pb2.DecodeResponse(index=index, token_ids=[token], finish_reason=finish)


@pytest.fixture
async def servers():
    started: list[grpc.aio.Server] = []

    async def serve(*servicers) -> str:
        server, _ = create_server()
        for s in servicers:
            add = (decode_pb2_grpc.add_DecodeServiceServicer_to_server if isinstance(s, FakeDecode)
                   else prefill_pb2_grpc.add_PrefillServiceServicer_to_server)
            add(s, server)
        addr = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
        await server.start()
        started.append(server)
        return addr

    yield serve
    for server in started:
        await server.stop(0)


async def backend_of(servers, prefill: prefill_pb2.PrefillResponse, decodes: list[FakeDecode], **kw):
    """A round-robin backend over a fake prefill worker and ``decodes`` (the first request goes to ``decodes[0]``)."""
    prefill_addrs = [await servers(FakePrefill(prefill))]
    decode_addrs = [await servers(d) for d in decodes]
    return static_backend(prefill_addrs, decode_addrs, **kw)


def remote(first: list[int], finishes: list[int] | None = None) -> prefill_pb2.PrefillResponse:
    return prefill_pb2.PrefillResponse(request_id="req-1", first_token_id=first[0], first_token_ids=first,
                                       kv_handle=HANDLE, finish_reasons=finishes or [])


async def run(backend, params: SamplingParams, deadline: float | None = None) -> list[TokenEvent]:
    try:
        return [ev async for ev in backend.generate("req-1", PROMPT, params, deadline)]
    finally:
        await backend.close()


def tokens_by_choice(events: list[TokenEvent]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in events:
        out.setdefault(ev.index, []).extend(ev.token_ids)
    return out


async def test_a_stream_whose_worker_dies_continues_on_another_with_the_tokens_sent(servers):
    a = FakeDecode([(0, 10, NONE), (0, 11, NONE), "die"])
    b = FakeDecode([(0, 12, NONE), (0, 13, LENGTH)])
    backend = await backend_of(servers, remote([5]), [a, b])
    params = SamplingParams(max_tokens=5, temperature=0.5, seed=9, logprobs=1, prompt_logprobs=1)
    events = await run(backend, params)
    assert [(ev.token_ids, ev.finish_reason, ev.index) for ev in events] == [
        ([5], None, 0), ([10], None, 0), ([11], None, 0), ([12], None, 0), ([13], "length", 0)]  # no duplicate, no gap
    (cont,) = b.requests
    assert list(cont.resume_output_token_ids) == [5, 10, 11] and list(cont.prompt_token_ids) == PROMPT
    assert not cont.HasField("kv_handle") and not cont.first_token_ids  # re-prefilled on the new worker
    assert sampling_from_proto(cont.sampling) == SamplingParams(max_tokens=5, temperature=0.5, seed=9, logprobs=1)
    assert cont.request_id == "req-1~m1c0"
    assert backend.counters["decode_migrations"] == 1
    assert not backend.registry.workers["decode"][0].up  # the dead worker left the rotation


async def test_only_unfinished_choices_continue_each_with_its_own_sampling_and_index(servers):
    # choice 1 ended at prefill, choice 3 on the first worker before it died; choices 0 and 2 continue
    a = FakeDecode([(0, 10, NONE), (2, 20, NONE), (3, 30, STOP), (2, 21, NONE), "die"])
    b = FakeDecode(by_id={"req-1~m1c0": [(0, 12, NONE), (0, 13, LENGTH)], "req-1~m1c2": [(0, 22, STOP)]})
    backend = await backend_of(servers, remote([5, 6, 7, 8], [NONE, STOP, NONE, NONE]), [a, b])
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=100, n=4)
    events = await run(backend, params)
    assert tokens_by_choice(events) == {0: [5, 10, 12, 13], 1: [6], 2: [7, 20, 21, 22], 3: [8, 30]}
    finishes = {ev.index: ev.finish_reason for ev in events if ev.finish_reason}
    assert finishes == {0: "length", 1: "stop", 2: "stop", 3: "stop"}
    conts = {r.request_id: r for r in b.requests}
    assert set(conts) == {"req-1~m1c0", "req-1~m1c2"}
    assert list(conts["req-1~m1c0"].resume_output_token_ids) == [5, 10]
    assert list(conts["req-1~m1c2"].resume_output_token_ids) == [7, 20, 21]
    for i in (0, 2):
        assert sampling_from_proto(conts[f"req-1~m1c{i}"].sampling) == params.for_choice(i)  # n 1, seed + i
    assert backend.counters["decode_migrations"] == 2


async def test_migration_off_or_no_worker_left_ends_the_stream_with_the_error(servers):
    for kw, decodes in ((dict(decode_migrations=0), 2), ({}, 1)):
        a = FakeDecode([(0, 10, NONE), "die"])
        others = [FakeDecode([(0, 12, LENGTH)]) for _ in range(decodes - 1)]
        backend = await backend_of(servers, remote([5]), [a, *others], **kw)
        got: list[int] = []
        with pytest.raises(WorkerUnavailable, match="decode worker"):
            async for ev in backend.generate("req-1", PROMPT, SamplingParams(max_tokens=4, temperature=0)):
                got += ev.token_ids
        await backend.close()
        assert got == [5, 10] and all(not o.requests for o in others)
        assert backend.counters["decode_migrations"] == 0


async def test_moves_are_bounded_per_choice(servers):
    def workers() -> tuple[list, list[FakeDecode]]:
        calls: list = []  # whichever of the other two is picked first dies too
        scripts = ([(0, 11, NONE), "die"], [(0, 12, NONE), (0, 13, LENGTH)])
        return calls, [FakeDecode([(0, 10, NONE), "die"]), *(FakeDecode(*scripts, requests=calls) for _ in range(2))]

    calls, decodes = workers()
    with pytest.raises(WorkerUnavailable):  # one move allowed: the continuation's death ends the request
        await run(await backend_of(servers, remote([5]), decodes), SamplingParams(max_tokens=5, temperature=0))
    assert len(calls) == 1
    calls, decodes = workers()
    backend = await backend_of(servers, remote([5]), decodes, decode_migrations=2)
    events = await run(backend, SamplingParams(max_tokens=5, temperature=0))
    assert tokens_by_choice(events) == {0: [5, 10, 11, 12, 13]}
    assert [list(r.resume_output_token_ids) for r in calls] == [[5, 10], [5, 10, 11]]
    assert calls[1].request_id == "req-1~m1c0~m2c0"
    assert backend.counters["decode_migrations"] == 2


async def test_a_continuation_that_fails_before_its_stream_starts_is_retried_like_any_decode_leg(servers):
    a = FakeDecode([(0, 10, NONE), "die"])
    calls: list = []
    scripts = (["die"], [(0, 11, LENGTH)])  # the first worker called refuses the continuation before sending anything
    b, c = FakeDecode(*scripts, requests=calls), FakeDecode(*scripts, requests=calls)
    backend = await backend_of(servers, remote([5]), [a, b, c], decode_attempts=2)
    events = await run(backend, SamplingParams(max_tokens=3, temperature=0))
    assert tokens_by_choice(events) == {0: [5, 10, 11]}
    assert [list(r.resume_output_token_ids) for r in calls] == [[5, 10], [5, 10]]


async def test_a_stalled_stream_migrates(servers):
    a = FakeDecode([(0, 10, NONE), "hang"])
    b = FakeDecode([(0, 11, LENGTH)])
    backend = await backend_of(servers, remote([5]), [a, b], decode_stall_timeout_s=0.2)
    events = await run(backend, SamplingParams(max_tokens=3, temperature=0))
    assert tokens_by_choice(events) == {0: [5, 10, 11]}
    assert backend.counters["decode_stalls"] == 1 and backend.counters["decode_migrations"] == 1


async def test_a_local_prefill_whose_worker_dies_before_a_choice_started_continues_it_from_scratch(servers):
    a = FakeDecode([(0, 10, NONE), "die"])  # choice 1 had no token yet
    b = FakeDecode(by_id={"req-1~m1c0": [(0, 11, LENGTH)], "req-1~m1c1": [(0, 20, NONE), (0, 21, LENGTH)]})
    backend = await backend_of(servers, remote([99]), [a, b])
    backend.disagg = DisaggregationPolicy("1000000")  # every prompt is prefilled on the decode worker
    events = await run(backend, SamplingParams(max_tokens=2, temperature=0, n=2))
    assert tokens_by_choice(events) == {0: [10, 11], 1: [20, 21]}
    conts = {r.request_id: list(r.resume_output_token_ids) for r in b.requests}
    assert conts == {"req-1~m1c0": [10], "req-1~m1c1": []}


async def test_the_deadline_bounds_the_continuation_and_ends_migration(servers):
    a = FakeDecode([(0, 10, NONE), "die"])
    b = FakeDecode([(0, 11, LENGTH)])
    backend = await backend_of(servers, remote([5]), [a, b])
    await run(backend, SamplingParams(max_tokens=3, temperature=0), deadline=time.monotonic() + 30)
    assert b.time_remaining[0] is not None and b.time_remaining[0] <= 30  # the continuation got the time left
    a = FakeDecode([(0, 10, NONE), "hang"])  # the deadline passes mid-stream: no move, DEADLINE_EXCEEDED
    b = FakeDecode([(0, 11, LENGTH)])
    backend = await backend_of(servers, remote([5]), [a, b])
    with pytest.raises(DeadlineExceeded):
        await run(backend, SamplingParams(max_tokens=3, temperature=0), deadline=time.monotonic() + 0.3)
    assert not b.requests and backend.counters["decode_migrations"] == 0


def test_choice_sampling_and_continuation_ids():
    msg = common_pb2.SamplingParams(max_tokens=8, n=3, seed=2**63 - 1, prompt_logprobs=2, logprobs=1)
    one = choice_sampling(msg, 2)
    assert not one.HasField("prompt_logprobs") and one.n == 0 and one.seed == 1 and one.logprobs == 1
    assert msg.n == 3 and msg.HasField("prompt_logprobs")  # the original is unchanged
    assert continuation_id("r" * 300, 12, 3) == "r" * (256 - 6) + "~m3c12"


async def test_merge_interleaves_raises_the_first_error_and_closes_every_stream():
    from splitserve.services.router.merge import merge

    closed: list[str] = []

    async def stream(name: str, items: list, fail: bool = False, hang: bool = False):
        try:
            for item in items:
                await asyncio.sleep(0)
                yield item
            if fail:
                raise WorkerUnavailable(f"{name} failed")
            if hang:
                await asyncio.sleep(3600)
        finally:
            closed.append(name)

    got = [x async for x in merge([stream("a", [1, 2, 3]), stream("b", [10, 20])])]
    assert sorted(got) == [1, 2, 3, 10, 20] and got.index(1) < got.index(2) < got.index(3) and got.index(10) < got.index(20)
    closed.clear()
    with pytest.raises(WorkerUnavailable, match="b failed"):
        async for _ in merge([stream("a", [1], hang=True), stream("b", [2], fail=True)]):
            pass
    assert sorted(closed) == ["a", "b"]  # the hanging stream was closed too
    closed.clear()
    merged = merge([stream("a", [1], hang=True), stream("b", [2], hang=True)])
    await anext(merged)
    await merged.aclose()  # the consumer leaves: every stream is closed before aclose returns
    assert sorted(closed) == ["a", "b"]
