"""UCX (ucxx) KV transfer backend: the decode worker pulls KV blocks from the prefill worker.

Protocol (one pull = one ``fetch``)
-----------------------------------
1. The receiver merges ``src_block_ids``/``dst_block_ids`` into *segments*: runs where both the remote and
   the local ids are consecutive, so each segment is one contiguous byte range on both sides.
2. It takes a ``tag_base`` unique in its process (tags match across the whole UCX worker, not per
   endpoint) and **posts every receive first**: the STATUS reply on ``tag_base`` and segment ``i`` on
   ``tag_base + 1 + i`` -- the latter directly into ``kv_cache[dst_start : dst_start + n]``.
3. It sends one FETCH request (UCX active message, :mod:`splitserve.transfer.wire`) with the transfer id,
   ``tag_base``, bytes per block, a layout digest and the source runs ``[(src_start, n)]``.
4. The sender checks the layout, then *claims* the registration: every requested block must be registered
   under that id (never serves other blocks). It posts the STATUS (OK / NOT_FOUND / INVALID /
   LAYOUT_MISMATCH / CLOSING) and, on OK, every segment straight from its own ``kv_cache`` slice; on any
   other status it sends an empty message on every segment tag, so the receiver's posted receives always
   complete without touching the destination blocks. When all sends completed it calls
   ``on_done(id, True)``; on failure it first aborts the endpoint (which cancels the posted sends, so UCX
   no longer reads the blocks) and then calls ``on_done(id, False)``.
5. Integrity (optional, receiver's ``verify_checksum``): the FETCH sets ``FLAG_CHECKSUM``; the sender
   computes xxh3-64 over the requested blocks (one pass over memory, before posting the sends) and puts it
   in the STATUS; once the data has landed the receiver hashes its destination blocks and compares
   (:class:`KVChecksumMismatch` on a difference). The data path itself is unchanged: still zero-copy.

Copies: **zero staging copies** in splitserve on either side -- UCX reads straight from the sender's KV
pool and writes straight into the receiver's KV pool, through numpy views of the two preallocated
tensors (no bytes objects, no pickling, no intermediate buffer; the only Python-level allocations are the
request header and a 1 KiB status buffer). The one exception is a prompt's partial last block: only its used
token rows move, ``2 * num_layers`` strided runs that the sender packs into one staging buffer and the receiver
unpacks (:mod:`splitserve.transfer.partial_block`; less than one block per transfer). What the transport itself does is UCX's choice: on one host,
with ``UCX_MM_ERROR_HANDLING=y``, ``UCX_PROTO_INFO=y`` shows "rendezvous fragmented copy-in copy-out" over
sysv shared memory for messages >= 8 KiB -- the sender's progress thread copies fragments of the pool
slice into a shared segment while the receiver's copies them out into its pool (2 memcpy by UCX,
pipelined; CMA's single copy is not selected because it lacks error handling), and "eager copy-in
copy-out" below 8 KiB. Between hosts it is TCP (kernel socket buffers) or, with an RDMA-capable UCX
build, zero-copy RDMA straight between the two pools.

Failure handling
----------------
* Unknown id: the sender answers NOT_FOUND -> :class:`TransferNotFound` after one round trip.
* Peer unreachable / dead port: connect fails within the fetch's ``timeout_s`` -> :class:`KVTransferError`.
* Peer dies mid-transfer: error handling is on for every endpoint, so posted receives fail with a
  connection reset and the cached endpoint is dropped -> :class:`KVTransferError`.
* Timeout: the endpoint to that peer is aborted (this cancels every receive posted on it, including
  those of *other* fetches from the same peer, which then fail too) -> :class:`KVTransferError`.

Cancellation (``asyncio.CancelledError``)
-----------------------------------------
ucxx cannot cancel one posted receive; cancelling the asyncio task leaves the UCX request posted, and it
would later write into blocks the caller has freed. So a cancelled fetch does not return until every
receive it posted has completed: it waits up to ``cancel_grace_s`` (bounded by the fetch's deadline) for
the sender -- which posts everything at once -- to finish; if receives are still pending after that, it
aborts the endpoint, which (``closeBlocking``) cancels the requests and returns only when UCX has
finished cancelling them. Only then is ``CancelledError`` re-raised. The cost of that fallback is that
concurrent fetches from the same peer fail with :class:`KVTransferError` and the next fetch reconnects.

Threads/loops: ucxx runs in ``progress_mode="thread"`` with Python futures, initialised inside the running
loop (:mod:`splitserve.transfer.ucx_runtime`); all methods except ``register``/``unregister`` must run on
that loop.

Modules (the UCX layer is shared with the KV store's data plane)
----------------------------------------------------------------
``ucx_sender`` (:class:`UcxKVSender`), ``ucx_receiver`` (:class:`UcxKVReceiver`); under both:
``ucx_runtime`` (process-wide init and shutdown), ``ucx_connect`` (the connection handshake, safe when the
peer hangs), ``ucx_endpoints`` (client endpoints, one per peer), ``ucx_listener`` (accepting connections
and dispatching their requests), ``ucx_requests`` (posting messages and settling them safely).
"""

from __future__ import annotations

from splitserve.transfer.ucx_receiver import UcxKVReceiver
from splitserve.transfer.ucx_sender import UcxKVSender

__all__ = ["UcxKVReceiver", "UcxKVSender"]
