"""KV transfer API: one sender/receiver interface, pluggable backends.

The prefill worker owns a :class:`KVSender` (it listens and serves pulls); the decode worker owns a
:class:`KVReceiver` and *pulls* a request's KV blocks from the prefill worker straight into its own
preallocated KV cache. gRPC carries only the control data (transfer id, the prefill's block ids and the
sender's ``endpoint``); KV bytes never go over gRPC.

Backends (``kind``):

* ``"ucx"``    -- :mod:`splitserve.transfer.ucx`, real processes over UCX (ucxx), zero staging copies (but for a partial last block's used rows).
* ``"inproc"`` -- :mod:`splitserve.transfer.inproc`, sender and receiver in one process (unit tests).

The KV cache may be in host or CUDA memory (the device is taken from the tensor); each side moves its bytes on one
*path*, ``host``, ``cuda`` or ``staged`` (:mod:`splitserve.transfer.paths`; option ``staging`` of both backends,
default ``PD_KV_TRANSFER_STAGING`` or "auto").

Backends are imported lazily, so importing this module never initialises UCX.

Errors raised by :meth:`KVReceiver.fetch` (all :class:`splitserve.errors.PdError`):

* :class:`TransferNotFound`  -- the sender holds no KV under that id (never registered, already sent,
  unregistered / lease expired).
* :class:`TransferRefused`   -- (a :class:`KVTransferError`) the request named blocks that were not
  registered under that id, or was otherwise malformed; the registration is left intact.
* :class:`KVLayoutMismatch`  -- the two KV layouts differ (bytes per block or layout digest).
* :class:`KVChecksumMismatch` -- (a :class:`KVTransferError`) with ``verify_checksum``: the bytes that
  arrived differ from the sender's xxh3-64 of its blocks. The destination blocks hold garbage.
* :class:`KVTransferError`   -- peer unreachable, connection reset, timeout, sender closing.
* :class:`InvalidRequest`    -- the local arguments are wrong (length mismatch, ids out of range, ...).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from splitserve.errors import KVTransferError
from splitserve.transfer.layout import KVLayout

if TYPE_CHECKING:
    import torch

    from splitserve.transfer.push import PushResult, PushSource, PushTable

__all__ = [
    "KVReceiver",
    "KVSender",
    "OnDone",
    "TransferRefused",
    "TransferStats",
    "create_receiver",
    "create_sender",
    "supported_kinds",
]

#: ``on_done(transfer_id, ok)``: called exactly once per registered transfer that was started (served,
#: failed or cancelled by ``close``); never called after ``unregister`` returned True.
OnDone = Callable[[str, bool], None]


class TransferRefused(KVTransferError):
    """The sender refused a fetch: a requested block is not registered under that transfer id, or the
    request was malformed. Not retryable; the sender keeps the registration."""


@dataclass
class TransferStats:
    """Counters of one sender or receiver (plain ints; read them from the event-loop thread)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    checksum_failures: int = 0  # receiver: transfers whose bytes did not match the sender's checksum

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class KVSender(ABC):
    """Prefill side: owns a listener and serves pulls of registered blocks of its KV cache.

    ``register``/``unregister`` are thread-safe (an engine thread may call them); everything else runs on
    the event loop that called :meth:`start`. ``on_done`` callbacks run on that event loop.
    """

    stats: TransferStats
    push_table: PushTable  # push subscriptions and sources (:mod:`splitserve.transfer.push`)
    #: how KV bytes meet this side's cache: "host", "cuda" or "staged" (:mod:`splitserve.transfer.paths`)
    path: str = "host"

    def open_push(self, bootstrap_id: str, num_blocks: int, wait_s: float | None = None) -> PushSource:
        """Start pushing a prompt of ``num_blocks`` KV blocks to the decode worker that subscribes (or subscribed)
        under ``bootstrap_id`` (:class:`~splitserve.transfer.push.PushSource`; event loop). Raises ValueError on a
        duplicate id."""
        return self.push_table.open(bootstrap_id, num_blocks, wait_s)

    @abstractmethod
    async def start(self) -> None:
        """Start listening. Must be awaited inside the running event loop that will serve transfers."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """``"host:port"`` to advertise to receivers (valid after :meth:`start`)."""

    @abstractmethod
    def register(self, transfer_id: str, block_ids: list[int], on_done: OnDone) -> None:
        """Declare that the KV of ``transfer_id`` lives in these local blocks (must not be written until
        ``on_done`` fires or ``unregister`` returns True). Raises ValueError on a duplicate id or block ids
        out of range."""

    @abstractmethod
    def unregister(self, transfer_id: str) -> bool:
        """Drop a registration without sending. True if it was registered and not yet being served; then
        ``on_done`` is never called. False if unknown or a fetch already claimed it (``on_done`` follows)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening, fail in-flight and pending transfers (``on_done(id, False)``), release UCX."""


class KVReceiver(ABC):
    """Decode side: pulls remote blocks into the local KV cache."""

    stats: TransferStats
    #: how KV bytes meet this side's cache: "host", "cuda" or "staged" (:mod:`splitserve.transfer.paths`)
    path: str = "host"

    @abstractmethod
    async def start(self) -> None:
        """Prepare the backend. Must be awaited inside the running event loop used for fetches."""

    @abstractmethod
    async def fetch(
        self,
        endpoint: str,
        transfer_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        timeout_s: float,
        last_block_tokens: int = 0,
        first_block_held: int = 0,
    ) -> int:
        """Copy remote block ``src_block_ids[i]`` into local block ``dst_block_ids[i]`` for all i.

        ``last_block_tokens``: tokens the last block holds (a prompt's ``len % block_size``); in
        ``(0, block_size)`` only its token rows ``[0, last_block_tokens)`` move (for every layer, K and V) and
        the rest of the destination block is left as it was; 0 or ``block_size``: the whole block. Out of
        range: InvalidRequest.

        ``first_block_held``: token rows ``[0, first_block_held)`` the first destination block already holds (a
        partly held block copied from the prefix cache); in ``(0, block_size)`` only its rows from there on move
        (up to ``last_block_tokens`` when it is also the last block; InvalidRequest when no row is left); 0: all.

        Returns the number of bytes moved (whole blocks times ``block_nbytes`` plus each partial block's moved
        rows times ``block_nbytes // block_size``). Never waits past ``timeout_s`` (plus a bounded cancel step).
        Cancel-safe: when it raises (including ``asyncio.CancelledError``) no receive into the destination
        blocks is left posted, so the caller may free them at once.
        """

    async def receive_push(self, endpoint: str, bootstrap_id: str, dst_block_ids: list[int], layer_groups: int,
                           timeout_s: float) -> PushResult:
        """Subscribe under ``bootstrap_id`` on the sender at ``endpoint`` and wait (at most ``timeout_s``) until the
        prompt's KV was pushed into local blocks ``dst_block_ids`` (in prompt order) and its completion arrived.
        ``layer_groups``: messages per block (0: one per layer). Raises KVTransferError (the prefill failed, no
        prefill request came, unreachable, timeout, connection lost), KVChecksumMismatch (with verify_checksum),
        KVLayoutMismatch, InvalidRequest. Cancel-safe like :meth:`fetch`."""
        raise KVTransferError(f"{type(self).__name__} cannot receive KV pushes")

    @abstractmethod
    async def close(self) -> None:
        """Close connections to all peers and release UCX."""


# --------------------------------------------------------------------------------------------------------
# Backend registry (lazy imports)

_BACKENDS: dict[str, tuple[str, str, str]] = {
    # kind: (module, sender class, receiver class)
    "ucx": ("splitserve.transfer.ucx", "UcxKVSender", "UcxKVReceiver"),
    "inproc": ("splitserve.transfer.inproc", "InprocKVSender", "InprocKVReceiver"),
}


def supported_kinds() -> list[str]:
    return sorted(_BACKENDS)


def _backend(kind: str, which: int):
    try:
        spec = _BACKENDS[kind]
    except KeyError:
        raise ValueError(f"unknown KV transfer kind {kind!r}; supported: {', '.join(supported_kinds())}") from None
    module = importlib.import_module(spec[0])
    return getattr(module, spec[which])


def create_sender(
    kind: str, kv_cache: torch.Tensor, layout: KVLayout, *, host: str = "127.0.0.1", port: int = 0, **options
) -> KVSender:
    """Create (not start) a sender serving ``kv_cache``. ``host`` is the advertised host (a wildcard such as
    0.0.0.0 is replaced by this machine's address); ``port`` 0 picks a free one. Extra keyword options go to the backend
    (ucx: ``send_timeout_s``; all: ``staging``, ``corrupt_sends`` -- fault injection for tests, see
    :mod:`splitserve.transfer.faults`)."""
    return _backend(kind, 1)(kv_cache, layout, host=host, port=port, **options)


def create_receiver(kind: str, kv_cache: torch.Tensor, layout: KVLayout, **options) -> KVReceiver:
    """Create (not start) a receiver writing into ``kv_cache``. Extra keyword options go to the backend
    (all: ``verify_checksum`` -- ask the sender for a checksum of every transfer and verify it; ``staging``; ucx:
    ``cancel_grace_s``)."""
    return _backend(kind, 2)(kv_cache, layout, **options)
