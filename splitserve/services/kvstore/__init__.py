"""Distributed KV-cache store in the manner of Mooncake Store.

``master/``: the metadata master (gRPC ``KVStoreMasterService``): segments, objects, replicas, two-phase
puts, read leases, eviction, zombie-write reclamation. Control only; it never sees object bytes.
``node/``: a storage node: one preallocated memory segment served over UCX, a tiny gRPC health/stats
surface, mount + heartbeats to the master. Clients (prefill/decode workers) use ``splitserve.kvstore``.
"""
