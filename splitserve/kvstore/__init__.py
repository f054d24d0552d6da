"""Client side of the distributed KV-cache store (splitserve/services/kvstore): block hashing, the store client
(master over gRPC, object bytes over UCX), and whole-KV-block load/save for an engine's cache.

Modules: ``block_hash`` (keys), ``client`` (KVStoreClient), ``data_client`` (UCX data plane, on the UCX
layer it shares with the KV transfer: ``splitserve.transfer.ucx_*``), ``suspects`` (nodes that failed
recently), ``wire`` (data-plane messages), ``kv_blocks`` (KVBlockStore), ``config`` (worker flags).
Importing this package imports none of them.
"""
