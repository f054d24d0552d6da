"""KVStoreMasterService on an in-process gRPC server (fake clock) driven by the real KVStoreClient:
per-key typed results of batch calls, typed errors of single calls, prefix lookups."""

import grpc
import pytest
from pd.v1 import common_pb2, kvstore_pb2 as kv, kvstore_pb2_grpc

from splitserve.errors import ObjectAlreadyExists, ObjectHasLease, ObjectNotFound, ObjectNotReady, StoreNoSpace, WriteRevoked
from splitserve.kvstore.client import KVStoreClient, ObjectLocation, PutTicket
from splitserve.rpc.server import bind, create_server
from splitserve.services.kvstore.master.config import MasterConfig
from splitserve.services.kvstore.master.core import KVStoreMaster
from splitserve.services.kvstore.master.server import KVStoreMasterServicer
from tests.test_kvstore_master import FakeClock


@pytest.fixture
async def store():
    clock = FakeClock()
    servicer = KVStoreMasterServicer(KVStoreMaster(MasterConfig(lease_s=2.0), clock))
    server, _ = create_server()
    kvstore_pb2_grpc.add_KVStoreMasterServiceServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    address = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(address) as ch:
        stub = kvstore_pb2_grpc.KVStoreMasterServiceStub(ch)
        resp = await stub.MountSegment(kv.MountSegmentRequest(node_id="n0", endpoint="127.0.0.1:9", size=8192))
        assert resp.heartbeat_timeout_ms == 5000
    client = KVStoreClient(address, clock=clock)  # control plane only: UCX is never started here
    yield client, servicer, clock, address
    await client.close()
    await server.stop(0)


async def test_batch_put_and_prefix_lookup(store):
    client, servicer, clock, _ = store
    tickets = await client.put_start(["a", "b", "c"], 1000)
    assert all(isinstance(t, PutTicket) and t.replicas[0].endpoint == "127.0.0.1:9" for t in tickets)
    assert await client.put_end(tickets[:2], [11, 22]) == [None, None]
    assert await client.exist(["a", "b", "c", "zz"]) == [True, True, False, False]
    full = await client.lookup(["a", "b", "c", "zz"])
    assert [type(r) for r in full] == [ObjectLocation, ObjectLocation, ObjectNotReady, ObjectNotFound]
    assert full[1].checksum == 22 and full[0].lease_deadline == clock.now + 2.0
    prefix = await client.lookup(["a", "zz", "b"], prefix=True)  # stops at the first miss: no lease on "b"
    assert [type(r) for r in prefix] == [ObjectLocation, ObjectNotFound]
    again = await client.put_start(["a", "c", "d"], 1000)
    assert isinstance(again[0], ObjectAlreadyExists) and isinstance(again[1], ObjectAlreadyExists)
    assert isinstance(again[2], PutTicket)
    assert isinstance((await client.put_start(["huge"], 10**6))[0], StoreNoSpace)
    assert isinstance((await client.put_end([PutTicket("c", 999, 1000, ())], [1]))[0], WriteRevoked)
    await client.put_revoke([tickets[2]])
    assert isinstance((await client.lookup(["c"]))[0], ObjectNotFound)


async def test_single_calls_fail_with_typed_errors(store):
    client, _, clock, address = store
    with pytest.raises(ObjectNotFound):
        await client.remove("nope")
    t = (await client.put_start(["k"], 100))[0]
    with pytest.raises(ObjectNotReady):
        await client.remove("k")
    await client.put_end([t], [5])
    await client.lookup(["k"])
    with pytest.raises(ObjectHasLease):
        await client.remove("k")
    clock.advance(2.5)
    await client.remove("k")
    async with grpc.aio.insecure_channel(address) as ch:
        stub = kvstore_pb2_grpc.KVStoreMasterServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetReplicaList(kv.GetReplicaListRequest(key="k"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutStart(kv.PutStartRequest(key="", size=1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = await stub.PutStart(kv.PutStartRequest(key="s", size=64))
        assert ok.status == kv.STORE_STATUS_OK and ok.replicas[0].size == 64
        batch = await stub.BatchGetReplicaList(kv.BatchGetReplicaListRequest(keys=["s", "k"]))
        assert [(r.status, r.state) for r in batch.results] == [
            (kv.STORE_STATUS_NOT_READY, kv.OBJECT_STATE_PROCESSING), (kv.STORE_STATUS_NOT_FOUND, kv.OBJECT_STATE_UNSPECIFIED)]
        stats = (await stub.GetStats(common_pb2.GetStatsRequest())).counters
    assert stats["puts_started"] == 2 and stats["grpc_bytes_received"] > 0


def test_no_message_of_the_store_protocol_carries_bytes():
    """The master's API has no field that could carry object bytes (control only)."""
    from google.protobuf.descriptor import FieldDescriptor

    for msg in kv.DESCRIPTOR.message_types_by_name.values():
        for f in msg.fields:
            assert f.type != FieldDescriptor.TYPE_BYTES, f"{msg.name}.{f.name}"
