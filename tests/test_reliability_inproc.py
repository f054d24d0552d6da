"""Failure handling, cancellation, deadlines and hostile input on a whole deployment in one process
(real engines and gRPC servers, inproc KV transport). Every test ends with every pool back to baseline."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2

from splitserve.client import RouterClient
from splitserve.engine.sampling import SamplingParams
from splitserve.rpc.server import channel
from splitserve.rpc.tls import TlsConfig
from tests.certs import make_pki
from tests.inproc_cluster import InprocCluster

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside"


@pytest.fixture
def prompt_ids(lm):
    return lm.tokenizer.encode(PROMPT)


async def started(lm, **kw) -> InprocCluster:
    return await InprocCluster(lm, **kw).start()


async def generate(cluster: InprocCluster, prompt_ids, max_tokens=24, tls=None, api_key=None, timeout=None) -> list[int]:
    ids = []
    async with RouterClient(cluster.router_address, tls=tls or cluster.tls, api_key=api_key) as client:
        async for r in client.generate(prompt_ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout):
            ids += r.token_ids
    return ids


async def reference(cluster: InprocCluster, prompt_ids, max_tokens=24) -> list[int]:
    """Tokens of a local generation on the last decode worker's engine (the same model)."""
    out = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for o in cluster.decode[-1].engine.generate(f"ref-{uuid.uuid4().hex}", prompt_ids, params):
        out += o.token_ids
    return out


def slow_steps(engine, seconds: float) -> None:
    """Make every forward pass of ``engine`` take ``seconds`` longer (runs on the engine thread)."""
    inner = engine.core.runner.execute

    def execute(seqs):
        time.sleep(seconds)
        return inner(seqs)

    engine.core.runner.execute = execute


# ------------------------------------------------------------------------------------------- worker failures


async def test_prefill_failure_is_retried_on_another_worker(lm, prompt_ids):
    c = await started(lm, dead_prefill=1)
    try:
        assert await generate(c, prompt_ids) == await reference(c, prompt_ids)
        assert c.backend.counters["prefill_retries"] == 1 and c.backend.counters["local_prefill_fallbacks"] == 0
        await c.wait_idle()
    finally:
        await c.stop()


async def test_no_prefill_worker_left_the_decode_worker_prefills(lm, prompt_ids):
    c = await started(lm, num_prefill=0, dead_prefill=2)
    try:
        assert await generate(c, prompt_ids) == await reference(c, prompt_ids)
        assert c.backend.counters["prefill_retries"] == 1 and c.backend.counters["local_prefill_fallbacks"] == 1
        assert (await c.worker_stats())[0]["local_prefills"] == 1
        await c.wait_idle()
        c.backend.local_prefill_fallback = False
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(c, prompt_ids)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "prefill worker" in err.value.details()
        await c.wait_idle()
    finally:
        await c.stop()


async def test_decode_failure_before_first_token_is_retried(lm, prompt_ids):
    c = await started(lm, dead_decode=1)
    try:
        assert await generate(c, prompt_ids) == await reference(c, prompt_ids)
        assert c.backend.counters["decode_retries"] == 1
        await c.wait_idle()  # the KV was pulled by the second decode worker, nothing held
    finally:
        await c.stop()


async def test_unreachable_data_path_falls_back_and_kv_is_released_at_once(lm, prompt_ids):
    # the prefill worker advertises a KV endpoint nobody serves: the pull fails, decode recomputes
    c = await started(lm, advertise="127.0.0.1:9", lease_s=30.0)
    try:
        assert await generate(c, prompt_ids) == await reference(c, prompt_ids)
        p, d = await c.worker_stats()
        assert d["kv_transfer_fallbacks"] == 1 and d["kv_transfers_failed"] == 1
        assert c.backend.counters["kv_recomputed"] == 1
        assert await c.wait_idle() < 1.0  # released by the router (ReleaseKV), not by the 30 s lease
        assert c.backend.counters["kv_released"] == 1 and c.prefill[0].servicer.leases.expired == 0
        # --kv-transfer-failure error: a clear UNAVAILABLE, and the KV is released too
        c.decode[0].servicer.worker.transfer_failure = "error"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(c, prompt_ids)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no inproc KV sender" in err.value.details()
        assert await c.wait_idle() < 1.0
    finally:
        await c.stop()


async def test_corrupted_transfer_is_detected_and_recomputed(lm, prompt_ids):
    c = await started(lm, corrupt=True, verify_checksum=True)
    try:
        assert await generate(c, prompt_ids) == await reference(c, prompt_ids)
        _p, d = await c.worker_stats()
        assert d["kv_checksum_failures"] == 1 and d["kv_transfer_fallbacks"] == 1
        await c.wait_idle()
    finally:
        await c.stop()


# ------------------------------------------------------------------------------------------- cancellation


async def test_cancel_mid_prefill_drops_the_work_within_1s(lm, prompt_ids):
    c = await started(lm)
    try:
        slow_steps(c.prefill[0].engine, 0.6)
        tasks_before = len(asyncio.all_tasks())
        ch, stub = c.router_stub()
        call = stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=prompt_ids),
                                                        sampling=common_pb2.SamplingParams(max_tokens=8)))
        while c.prefill[0].servicer.worker.in_flight == 0:  # (engine stats would wait for the slow step)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the engine is inside the prefill forward pass now
        call.cancel()
        t0 = time.monotonic()
        await c.wait_idle(timeout_s=1.0)
        assert time.monotonic() - t0 < 1.0
        p = (await c.worker_stats())[0]
        assert p["requests"] == 0 and p["kv_transfers_held"] == 0  # the prefill never answered, nothing held
        await ch.close()
        await asyncio.sleep(0.05)
        assert len(asyncio.all_tasks()) <= tasks_before  # no task left behind
    finally:
        await c.stop()


async def test_cancel_mid_stream_frees_both_sides_within_1s(lm, prompt_ids):
    c = await started(lm)
    try:
        slow_steps(c.decode[0].engine, 0.005)
        ch, stub = c.router_stub()
        call = stub.Generate(router_pb2.GenerateRequest(
            prompt_token_ids=router_pb2.TokenIds(ids=prompt_ids),
            sampling=common_pb2.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)))
        n = 0
        async for _ in call:
            n += 1
            if n == 3:
                break
        assert (await c.worker_stats())[1]["requests_running"] == 1
        call.cancel()
        assert await c.wait_idle(timeout_s=1.0) < 1.0
        await ch.close()
    finally:
        await c.stop()


async def test_dropped_streams_stop_the_workers(lm, prompt_ids):
    """The router's stream of a request (which owns its decode call) and the gRPC client's stream are
    dropped mid-stream without being closed or cancelled: garbage collection finalizes them, which
    cancels their calls, and every worker stops within 1 s."""
    c = await started(lm)
    try:
        slow_steps(c.decode[0].engine, 0.005)
        params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        events = c.backend.generate("dropped-1", prompt_ids, params)
        await anext(events)
        await anext(events)
        assert (await c.worker_stats())[1]["requests_running"] == 1
        del events  # never closed: its decode call is never cancelled explicitly
        gc.collect()
        assert await c.wait_idle(timeout_s=1.0) < 1.0
        async with RouterClient(c.router_address) as client:
            stream = client.generate(prompt_ids, max_tokens=300, temperature=0.0, ignore_eos=True)
            await anext(stream)
            await anext(stream)
            assert (await c.worker_stats())[1]["requests_running"] == 1
            del stream
            gc.collect()
            assert await c.wait_idle(timeout_s=1.0) < 1.0
    finally:
        await c.stop()


# ------------------------------------------------------------------------------------------- deadlines


async def test_expired_deadline_is_deadline_exceeded_and_stops_the_work(lm, prompt_ids):
    c = await started(lm, request_timeout_s=0.4)
    try:
        slow_steps(c.decode[0].engine, 0.005)  # 300 tokens take > 1.5 s
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(c, prompt_ids, max_tokens=300, timeout=0.4)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.0
        assert await c.wait_idle(timeout_s=1.0) < 1.0
        body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        async with c.http() as http:  # HTTP: the router's request timeout (0.4 s)
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
            assert await c.wait_idle(timeout_s=1.0) < 1.0
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
        assert await c.wait_idle(timeout_s=1.0) < 1.0
        events = [e for e in streamed.text.split("\n\n") if e]  # streaming had started: an SSE error event
        assert events[-1] == "data: [DONE]" and '"code": "deadline_exceeded"' in events[-2]
    finally:
        await c.stop()


class _RecordingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, seen):
        self.seen = seen

    async def Prefill(self, request, context):
        self.seen.append(("prefill", context.time_remaining()))
        return prefill_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=5,
            kv_handle=common_pb2.KVHandle(transfer_id="t", endpoint="127.0.0.1:9", block_ids=[0], num_tokens=1))

    async def ReleaseKV(self, request, context):
        return prefill_pb2.ReleaseKVResponse(released=False)


class _RecordingDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, seen):
        self.seen = seen

    async def Decode(self, request, context):
        self.seen.append(("decode", context.time_remaining()))
        yield decode_pb2.DecodeResponse(token_ids=[6], finish_reason=common_pb2.FINISH_REASON_LENGTH)


async def test_deadlines_propagate_as_remaining_time_and_none_is_imposed(lm):
    from splitserve.frontend.http_app import build_app
    from splitserve.rpc.server import bind, create_server
    from splitserve.served_model import ServedModel
    from tests.inproc_cluster import static_backend
    from splitserve.frontend.grpc_api import RouterServicer
    from pd.v1 import router_pb2_grpc
    import httpx

    seen: list = []
    server, _ = create_server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_RecordingPrefill(seen), server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_RecordingDecode(seen), server)
    router_pb2_grpc.add_RouterServiceServicer_to_server(
        RouterServicer(backend := static_backend([addr := "127.0.0.1:%d" % bind(server, "127.0.0.1", 0)], [addr],
                                                 prefill_timeout_s=60.0), lm.tokenizer, lm.max_model_len), server)
    await server.start()
    try:
        async with RouterClient(addr) as client:
            async for _ in client.generate("Once upon a time", max_tokens=2, timeout=5.0):
                pass
            assert [k for k, _ in seen] == ["prefill", "decode"]
            # the time left, hop after hop (the grpc-timeout header rounds up a little: + 0.1 s)
            assert 4.0 < seen[0][1] <= 5.1 and 4.0 < seen[1][1] <= seen[0][1] + 0.1
            seen.clear()
            async for _ in client.generate("Once upon a time", max_tokens=2):  # no deadline
                pass
            assert 59.0 < seen[0][1] <= 60.1 + 0.5  # only the prefill hop's liveness guard
            assert seen[1] == ("decode", None)  # the stream gets no deadline at all
        seen.clear()
        app = build_app(ServedModel("tiny", lm.tokenizer, lm.max_model_len), backend, request_timeout_s=3.0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
            r = await http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2})
        assert r.status_code == 200 and 2.0 < seen[0][1] <= 3.1 and 2.0 < seen[1][1] <= 3.1
    finally:
        await backend.close()
        await server.stop(0)


# ------------------------------------------------------------------------------------------- hostile input


async def test_requests_without_router_fields_are_refused_by_workers(lm, prompt_ids):
    c = await started(lm)
    try:
        async with channel(c.prefill[0].address) as pch, channel(c.decode[0].address) as dch:
            prefill, decode = prefill_pb2_grpc.PrefillServiceStub(pch), decode_pb2_grpc.DecodeServiceStub(dch)
            sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0)
            bad_prefills = [
                prefill_pb2.PrefillRequest(prompt_token_ids=prompt_ids, sampling=sampling),  # no request_id
                prefill_pb2.PrefillRequest(request_id="x", prompt_token_ids=prompt_ids),  # no sampling.max_tokens
                prefill_pb2.PrefillRequest(request_id="x" * 300, prompt_token_ids=prompt_ids, sampling=sampling),
            ]
            for req in bad_prefills:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill.Prefill(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            good = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id="ok", prompt_token_ids=prompt_ids, sampling=sampling))
            handle = good.kv_handle
            no_endpoint = common_pb2.KVHandle()
            no_endpoint.CopyFrom(handle)
            no_endpoint.endpoint = ""
            bad_decodes = [
                decode_pb2.DecodeRequest(prompt_token_ids=prompt_ids, sampling=sampling),  # no request_id
                decode_pb2.DecodeRequest(request_id="d", prompt_token_ids=prompt_ids),  # no sampling.max_tokens
                decode_pb2.DecodeRequest(request_id="d", prompt_token_ids=prompt_ids, sampling=sampling, kv_handle=handle),
                decode_pb2.DecodeRequest(request_id="d", prompt_token_ids=prompt_ids, sampling=sampling, kv_handle=no_endpoint,
                                         first_token_id=good.first_token_id),
                decode_pb2.DecodeRequest(request_id="d", prompt_token_ids=prompt_ids, sampling=sampling, kv_handle=handle,
                                         first_token_id=10**6),  # outside the vocabulary: must not reach the model
                decode_pb2.DecodeRequest(request_id="d", prompt_token_ids=[1, 10**6], sampling=sampling),
            ]
            for req in bad_decodes:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in decode.Decode(req):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            ids = [t async for m in decode.Decode(decode_pb2.DecodeRequest(
                request_id="d-ok", prompt_token_ids=prompt_ids, sampling=sampling, kv_handle=handle,
                first_token_id=good.first_token_id)) for t in m.token_ids]
            assert len(ids) == 3  # the KV handle was still usable: nothing above touched it
        assert len(await generate(c, prompt_ids)) == 24
        await c.wait_idle()
    finally:
        await c.stop()


@pytest.mark.parametrize("method", ["/pd.v1.RouterService/Generate", "/pd.v1.PrefillService/Prefill", "/pd.v1.DecodeService/Decode"])
async def test_malformed_protobuf_is_invalid_argument(lm, prompt_ids, method):
    c = await started(lm)
    try:
        target = {"Router": c.router_address, "Prefill": c.prefill[0].address, "Decode": c.decode[0].address}
        address = target[method.split(".")[2].split("Service")[0]]
        async with channel(address) as ch:
            stream = "Prefill" not in method
            call = (ch.unary_stream if stream else ch.unary_unary)(method)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if stream:
                    async for _ in call(b"\xff\xff\xff\xff\x0f"):
                        pass
                else:
                    await call(b"\xff\xff\xff\xff\x0f")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in err.value.details()
        assert len(await generate(c, prompt_ids)) == 24
        await c.wait_idle()
    finally:
        await c.stop()


async def test_oversized_messages_are_refused(lm, prompt_ids):
    c = await started(lm)
    try:
        big = "Once upon a time " * (17 * 2**20 // 17 + 1)  # > 16 MiB
        with pytest.raises(grpc.aio.AioRpcError) as err:  # our own channels refuse to send it
            await generate(c, big)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        opts = [("grpc.max_send_message_length", 64 * 2**20)]
        async with grpc.aio.insecure_channel(c.router_address, options=opts) as ch:  # a client that would send it
            call = ch.unary_stream("/pd.v1.RouterService/Generate")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call(router_pb2.GenerateRequest(prompt=big).SerializeToString()):
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(await generate(c, prompt_ids)) == 24
        await c.wait_idle()
    finally:
        await c.stop()


# ------------------------------------------------------------------------------------------- security


async def test_api_key_on_http_and_grpc(lm, prompt_ids):
    c = await started(lm, api_key="s3cret-key")
    try:
        for key in (None, "wrong"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c, prompt_ids, api_key=key)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with RouterClient(c.router_address, api_key=key) as client:
                    await client.stats()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(await generate(c, prompt_ids, api_key="s3cret-key")) == 24
        async with RouterClient(c.router_address, api_key="s3cret-key") as client:
            assert (await client.stats())["requests"] == 1
        async with channel(c.router_address) as ch:  # health stays open (load balancers, the launcher)
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        body = {"prompt": "Once upon a time", "max_tokens": 4}
        async with c.http() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}):
                r = await http.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
            assert (await http.get("/v1/models")).status_code == 401
            assert (await http.get("/health")).status_code == 200
            r = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret-key"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        await c.wait_idle()
    finally:
        await c.stop()


async def test_mutual_tls_on_every_hop(lm, prompt_ids, tmp_path):
    pki = make_pki(tmp_path)
    tls = TlsConfig(pki.cert, pki.key, pki.ca, client_auth=True)
    c = await started(lm, tls=tls)
    try:
        assert await generate(c, prompt_ids) == await reference(c, prompt_ids)  # router -> prefill, decode over mTLS
        refused = [
            None,  # plaintext
            TlsConfig(ca_file=pki.ca),  # TLS without a client certificate
            TlsConfig(pki.other_cert, pki.other_key, pki.ca),  # a client certificate from another CA
        ]
        for client_tls in refused:
            for address in (c.router_address, c.prefill[0].address, c.decode[0].address):
                async with (channel(address, client_tls) if client_tls else grpc.aio.insecure_channel(address)) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (client_tls, address)
        async with channel(c.router_address, TlsConfig(pki.cert, pki.key, pki.other_ca)) as ch:  # server not trusted
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        await c.wait_idle()
    finally:
        await c.stop()


def test_tls_config_is_validated(tmp_path):
    pki = make_pki(tmp_path)
    with pytest.raises(ValueError, match="together"):
        TlsConfig(cert_file=pki.cert)
    with pytest.raises(ValueError, match="mutual TLS"):
        TlsConfig(pki.cert, pki.key, client_auth=True)
    with pytest.raises(ValueError, match="not found"):
        TlsConfig(ca_file=str(tmp_path / "missing.pem"))
    assert not TlsConfig().enabled and TlsConfig(ca_file=pki.ca).enabled
