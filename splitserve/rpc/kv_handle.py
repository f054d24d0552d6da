"""``pd.v1.KVHandle`` <-> :class:`splitserve.transfer.handle.KVHandle`."""

from __future__ import annotations

from pd.v1 import common_pb2

from splitserve.rpc.convert import layout_from_proto, layout_to_proto
from splitserve.transfer.handle import KVHandle


def handle_to_proto(h: KVHandle) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        request_id=h.request_id, transfer_id=h.transfer_id, num_tokens=h.num_tokens, layout=layout_to_proto(h.layout),
        transport=h.transport, endpoint=h.endpoint, block_ids=list(h.block_ids), lease_ms=h.lease_ms,
        via_store=h.via_store, store_tail_key=h.store_tail_key,
    )


def handle_from_proto(msg: common_pb2.KVHandle) -> KVHandle:
    return KVHandle(
        msg.request_id, msg.transfer_id, msg.num_tokens, layout_from_proto(msg.layout), msg.transport, msg.endpoint,
        tuple(msg.block_ids), msg.lease_ms, msg.via_store, msg.store_tail_key,
    )
