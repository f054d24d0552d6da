"""Tracing of a KV push: one ``kv.push.layers`` span per layer group sent (its layer range, blocks and bytes), a
child of the push's ``kv.send`` span; a group whose sending failed is an error span (inproc backend, in-memory
span exporter)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.errors import KVTransferError
from splitserve.transfer import create_receiver, create_sender
from splitserve.transfer.kv_cache import allocate_kv_cache
from splitserve.transfer.layout import KVLayout
from tests.telemetry_helpers import Spans

LAYOUT = KVLayout("test-model", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
LAYER_NBYTES = LAYOUT.block_nbytes // LAYOUT.num_layers


@pytest.fixture
def spans(monkeypatch):
    return Spans(monkeypatch)


@pytest.fixture
async def pair():
    sender = create_sender("inproc", allocate_kv_cache(LAYOUT, 16), LAYOUT)
    receiver = create_receiver("inproc", allocate_kv_cache(LAYOUT, 16), LAYOUT)
    await sender.start()
    await receiver.start()
    yield sender, receiver
    await receiver.close()
    await sender.close()


def layer_spans(spans: Spans):
    return sorted((s for s in spans.all() if s.name == "kv.push.layers"), key=lambda s: s.attributes["splitserve.kv.first_layer"])


@pytest.mark.parametrize("groups, bounds", [(0, [(0, 1), (1, 2), (2, 3), (3, 4)]), (2, [(0, 2), (2, 4)]), (1, [(0, 4)])])
async def test_each_layer_group_is_a_child_span_of_the_send(pair, spans, groups, bounds):
    sender, receiver = pair
    src_ids, dst_ids = [5, 2, 9], [0, 7, 3]
    task = asyncio.create_task(receiver.receive_push(sender.endpoint, "b1", dst_ids, groups, 5.0))
    await asyncio.sleep(0)
    source = sender.open_push("b1", 3)
    for n in range(1, LAYOUT.num_layers + 1):  # layer by layer, as the engine reports them
        source.layers_done(src_ids, n)
        await asyncio.sleep(0)
    assert await source.finish([11], src_ids, False, 5.0)
    await task
    send = spans.named("kv.send")
    layers = layer_spans(spans)
    assert [(s.attributes["splitserve.kv.first_layer"], s.attributes["splitserve.kv.end_layer"]) for s in layers] == bounds
    for s, (l0, l1) in zip(layers, bounds):
        assert s.parent is not None and s.parent.span_id == send.context.span_id
        assert s.context.trace_id == send.context.trace_id
        assert s.attributes["splitserve.kv.transfer_id"] == "b1" and s.attributes["splitserve.kv.blocks"] == 3
        assert s.attributes["splitserve.kv.bytes"] == 3 * (l1 - l0) * LAYER_NBYTES
        assert not Spans.is_error(s)
    assert sum(s.attributes["splitserve.kv.bytes"] for s in layers) == send.attributes["splitserve.kv.bytes"]


async def test_a_group_that_fails_to_send_is_an_error_span(pair, spans):
    sender, receiver = pair
    source = sender.open_push("g", 1)
    with pytest.raises(KVTransferError, match="timed out"):  # the decode side stops waiting after subscribing
        await receiver.receive_push(sender.endpoint, "g", [0], 0, 0.05)
    source.layers_done([4], 1)
    await asyncio.sleep(0)
    assert not await source.finish([1], [4], False, 1.0)
    (failed,) = layer_spans(spans)
    assert Spans.is_error(failed) and failed.attributes["splitserve.kv.first_layer"] == 0
    assert failed.parent.span_id == spans.named("kv.send").context.span_id and Spans.is_error(spans.named("kv.send"))
