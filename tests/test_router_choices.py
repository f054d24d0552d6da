"""The router carries n choices, logprobs and prompt logprobs across the prefill -> decode handoff (fake prefill and
decode workers over in-process gRPC): one TokenEvent per choice after prefill, then the decode stream's events, and
the same through the gRPC front door and the Python client."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2_grpc

from splitserve.client import RouterClient
from splitserve.engine.guided_spec import GuidedSpec
from splitserve.engine.logprobs import TokenLogprob
from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.backend import TokenEvent
from splitserve.frontend.grpc_api import RouterServicer
from splitserve.rpc.convert import logprob_to_proto, prompt_logprobs_to_proto, sampling_from_proto, sampling_to_proto
from splitserve.rpc.server import bind, create_server
from splitserve.services.router.disaggregation import DisaggregationPolicy
from tests.inproc_cluster import static_backend

STOP, LENGTH, NONE = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_UNSPECIFIED
PROMPT = [1, 40, 41, 42]
PARAMS = SamplingParams(
    max_tokens=3, temperature=0.5, top_p=0.75, top_k=20, seed=7, stop_token_ids=(3,), presence_penalty=0.5,
    frequency_penalty=0.25, repetition_penalty=1.2, min_p=0.1, min_tokens=1, logit_bias=((30, 5.0),),
    bad_words_token_ids=((31, 32),), allowed_token_ids=tuple(range(2, 100)), logprobs=2, prompt_logprobs=1, n=3,
    guided=GuidedSpec("regex", "[a-z]+"),
)


def lp(token: int, logprob: float) -> TokenLogprob:
    return TokenLogprob(token, logprob, 1, ((token, logprob), (token + 1, logprob - 1.0)))


PROMPT_LPS = [None, lp(40, -3.0), lp(41, -2.0), lp(42, -1.0)]


class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self) -> None:
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.response = prefill_pb2.PrefillResponse()

    async def Prefill(self, request, context):
        self.requests.append(request)
        return self.response

    async def ReleaseKV(self, request, context):
        return prefill_pb2.ReleaseKVResponse(released=True)


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.requests: list[decode_pb2.DecodeRequest] = []
        self.messages: list[decode_pb2.DecodeResponse] = []

    async def Decode(self, request, context):
        self.requests.append(request)
        for m in self.messages:
            yield m


def decode_msg(index: int, token: int, logprob: float, finish=NONE, **kw) -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(index=index, token_ids=[token], logprobs=[logprob_to_proto(lp(token, logprob))],
                                     finish_reason=finish, **kw)


HANDLE = common_pb2.KVHandle(request_id="r", transfer_id="t1", endpoint="127.0.0.1:9", block_ids=[0], num_tokens=4)


@pytest.fixture
async def w(tok):
    """A fake prefill and a fake decode worker, and the router's RouterService over them (round robin, always
    disaggregated), on one in-process server at ``w.addr``; ``w.backend`` is the router's RoutedBackend."""
    prefill, decode = FakePrefill(), FakeDecode()
    server, _ = create_server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, server)
    addr = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    backend = static_backend([addr], [addr])
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(backend, tok, 512), server)
    await server.start()
    yield SimpleNamespace(prefill=prefill, decode=decode, addr=addr, backend=backend)
    await backend.close()
    await server.stop(0)


async def events_of(backend, params=PARAMS) -> list[TokenEvent]:
    return [ev async for ev in backend.generate("req-1", PROMPT, params)]


def remote_response(**kw) -> prefill_pb2.PrefillResponse:
    fields = dict(
        request_id="req-1", first_token_id=5, first_token_ids=[5, 6, 7], kv_handle=HANDLE,
        first_logprobs=[logprob_to_proto(lp(t, -0.5 * i)) for i, t in enumerate([5, 6, 7])],
        prompt_logprobs=prompt_logprobs_to_proto(PROMPT_LPS), finish_reasons=[NONE, STOP, NONE], cached_tokens=0,
    )
    fields.update(kw)
    return prefill_pb2.PrefillResponse(**fields)


async def test_n3_with_logprobs_one_event_per_choice_then_the_decode_stream(w):
    prefill, decode = w.prefill, w.decode
    prefill.response = remote_response()
    decode.messages = [
        decode_msg(0, 10, -0.1), decode_msg(2, 20, -0.2),
        decode_msg(1, 99, -9.0),  # choice 1 ended at prefill: dropped
        decode_msg(0, 11, -0.3, LENGTH), decode_msg(2, 21, -0.4, STOP),
    ]
    events = await events_of(w.backend)
    assert events == [
        TokenEvent([5], None, 0, index=0, logprobs=[lp(5, -0.0)], prompt_logprobs=PROMPT_LPS),
        TokenEvent([6], "stop", 0, index=1, logprobs=[lp(6, -0.5)]),
        TokenEvent([7], None, 0, index=2, logprobs=[lp(7, -1.0)]),
        TokenEvent([10], None, 0, index=0, logprobs=[lp(10, -0.1)]),
        TokenEvent([20], None, 0, index=2, logprobs=[lp(20, -0.2)]),
        TokenEvent([11], "length", 0, index=0, logprobs=[lp(11, -0.3)]),
        TokenEvent([21], "stop", 0, index=2, logprobs=[lp(21, -0.4)]),
    ]
    # every sampling field reached both workers; the decode worker got every choice's first token and the handle
    (p,), (d,) = prefill.requests, decode.requests
    assert sampling_from_proto(p.sampling) == sampling_from_proto(d.sampling) == sampling_from_proto(sampling_to_proto(PARAMS))
    assert list(d.first_token_ids) == [5, 6, 7] and d.first_token_id == 5 and d.kv_handle == HANDLE
    assert list(p.prompt_token_ids) == list(d.prompt_token_ids) == PROMPT


async def test_prefill_that_finishes_every_choice_has_no_decode_leg(w):
    prefill, decode = w.prefill, w.decode
    params = SamplingParams(max_tokens=1, n=2, logprobs=0, temperature=0.0)
    prefill.response = prefill_pb2.PrefillResponse(
        request_id="req-1", first_token_id=5, first_token_ids=[5, 3], finish_reason=LENGTH, finish_reasons=[LENGTH, STOP],
        first_logprobs=[logprob_to_proto(TokenLogprob(5, -0.5)), logprob_to_proto(TokenLogprob(3, -1.5))],
    )
    events = await events_of(w.backend, params)
    assert events == [TokenEvent([5], "length", 0, index=0, logprobs=[TokenLogprob(5, -0.5)]),
                      TokenEvent([3], "stop", 0, index=1, logprobs=[TokenLogprob(3, -1.5)])]
    assert decode.requests == []


async def test_prefill_worker_without_choices_still_works(w):
    prefill, decode = w.prefill, w.decode
    params = SamplingParams(max_tokens=2, temperature=0.0)
    prefill.response = prefill_pb2.PrefillResponse(request_id="req-1", first_token_id=5, kv_handle=HANDLE, cached_tokens=2)
    decode.messages = [decode_pb2.DecodeResponse(token_ids=[8], finish_reason=LENGTH)]
    events = await events_of(w.backend, params)
    assert events == [TokenEvent([5], None, 2), TokenEvent([8], "length", 0)]
    (d,) = decode.requests
    assert d.first_token_id == 5 and list(d.first_token_ids) == [5]


async def test_local_prefill_streams_first_tokens_and_prompt_logprobs_from_the_decode_worker(w):
    prefill, decode = w.prefill, w.decode
    decode.messages = [
        decode_msg(0, 5, -0.5, prompt_logprobs=prompt_logprobs_to_proto(PROMPT_LPS)), decode_msg(1, 6, -0.6),
        decode_msg(2, 7, -0.7, STOP), decode_msg(0, 10, -0.1, LENGTH), decode_msg(1, 11, -0.2, LENGTH),
    ]
    w.backend.disagg = DisaggregationPolicy("1000000")  # every prompt is prefilled on the decode worker
    events = await events_of(w.backend)
    assert events == [
        TokenEvent([5], None, 0, index=0, logprobs=[lp(5, -0.5)], prompt_logprobs=PROMPT_LPS),
        TokenEvent([6], None, 0, index=1, logprobs=[lp(6, -0.6)]),
        TokenEvent([7], "stop", 0, index=2, logprobs=[lp(7, -0.7)]),
        TokenEvent([10], "length", 0, index=0, logprobs=[lp(10, -0.1)]),
        TokenEvent([11], "length", 0, index=1, logprobs=[lp(11, -0.2)]),
    ]
    (d,) = decode.requests
    assert prefill.requests == [] and not d.HasField("kv_handle") and not d.first_token_ids
    assert sampling_from_proto(d.sampling) == sampling_from_proto(sampling_to_proto(PARAMS))


async def test_grpc_front_door_and_client_carry_choices_and_logprobs(w, tok):
    prefill, decode = w.prefill, w.decode
    prefill.response = remote_response()
    decode.messages = [decode_msg(0, 10, -0.1), decode_msg(2, 20, -0.2, STOP), decode_msg(0, 11, -0.3, LENGTH)]
    async with RouterClient(w.addr) as client:
        msgs = [m async for m in client.generate(
            PROMPT, max_tokens=3, temperature=0.5, top_p=0.75, top_k=20, seed=7, stop_token_ids=[3], n=3, logprobs=2,
            prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2, min_p=0.1,
            min_tokens=1, logit_bias={30: 5.0}, bad_words_token_ids=[[31, 32]], allowed_token_ids=range(2, 100),
            guided=GuidedSpec("regex", "[a-z]+"),
        )]
    assert [(m.index, list(m.token_ids), m.finish_reason) for m in msgs] == [
        (0, [5], NONE), (1, [6], STOP), (2, [7], NONE), (0, [10], NONE), (2, [20], STOP), (0, [11], LENGTH)]
    assert [[(x.token_id, x.logprob) for x in m.logprobs] for m in msgs] == [
        [(5, -0.0)], [(6, -0.5)], [(7, -1.0)], [(10, -0.1)], [(20, -0.2)], [(11, -0.3)]]
    assert [m.HasField("prompt_logprobs") for m in msgs] == [True] + [False] * 5
    assert msgs[0].prompt_logprobs == prompt_logprobs_to_proto(PROMPT_LPS)
    assert [m.HasField("usage") for m in msgs] == [False] * 5 + [True]
    assert msgs[-1].usage.completion_tokens == 6 and msgs[-1].usage.prompt_tokens == len(PROMPT)
    assert sampling_from_proto(prefill.requests[0].sampling) == PARAMS  # the client's fields, unchanged, at the worker
    assert "".join(m.text for m in msgs if m.index == 0) == tok.decode([5, 10, 11])


async def test_grpc_front_door_refuses_token_ids_outside_the_vocabulary(w, tok):
    import grpc

    vocab = tok.hf.get_vocab_size(with_added_tokens=True)
    async with RouterClient(w.addr) as client:
        for kw in (dict(logit_bias={vocab: 1.0}), dict(bad_words_token_ids=[[1, vocab]]), dict(allowed_token_ids=[vocab]),
                   dict(min_tokens=5, max_tokens=4), dict(n=1000), dict(logprobs=21)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in client.generate(PROMPT, **kw):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
    assert w.prefill.requests == [] and w.decode.requests == []  # refused at the front door
