"""The KV handle: what a prefill worker tells the router (and the router the decode worker) about a
request's KV, as a plain value (``pd.v1.KVHandle`` on the wire, ``splitserve.rpc.kv_handle`` converts)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.transfer.layout import KVLayout


@dataclass(frozen=True, slots=True)
class KVHandle:
    request_id: str
    transfer_id: str  # names the KV held for one pull (direct) or the request's tail object (store)
    num_tokens: int  # tokens whose K/V the blocks hold (the prompt length)
    layout: KVLayout
    transport: str  # "ucx" or "inproc"
    endpoint: str  # data-plane address of the prefill worker, "host:port"
    block_ids: tuple[int, ...]  # prefill-side KV block ids, in sequence order
    lease_ms: int  # the prefill worker frees the blocks after this long
    via_store: bool = False  # store transfer mode: read the blocks from the KV store, not from the prefill worker
    store_tail_key: str = ""  # store key of the partial last block ("" when none)
