"""Backend-independent pieces of the KV transfer: registrations, segments, endpoints, argument checks.

No torch here (the store node uses the endpoint helpers); the KV cache tensor checks are in
:mod:`splitserve.transfer.kv_cache`.

Both backends use the same :class:`TransferTable`, so "which blocks may be served under which id" has
exactly one implementation.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Sequence

import xxhash

from splitserve.errors import InvalidRequest
from splitserve.transfer.base import OnDone
from splitserve.transfer.layout import KVLayout

logger = logging.getLogger("splitserve.transfer")

#: one run of consecutive blocks on both sides: (src_start, dst_start, count)
Segment = tuple[int, int, int]


class Status(enum.IntEnum):
    """Answer of a sender to a fetch request."""

    OK = 0
    NOT_FOUND = 1
    INVALID = 2
    LAYOUT_MISMATCH = 3
    CLOSING = 4
    FAILED = 5  # push: the prefill failed or the push could not be paired (detail says why)
    CANCELLED = 6  # push: the prefill request was cancelled by its caller (the client went away)


# --------------------------------------------------------------------------------------------------------
# layout


def layout_digest(layout: KVLayout) -> int:
    """64-bit digest of everything that must match between sender and receiver."""
    return int.from_bytes(hashlib.blake2b(layout.describe().encode(), digest_size=8).digest(), "little")


# --------------------------------------------------------------------------------------------------------
# integrity


def segments_checksum(pool_bytes, runs: Sequence[tuple[int, int]], block_nbytes: int) -> int:
    """xxh3-64 over the bytes of blocks ``[start, start + count)`` of each run, in order.

    ``pool_bytes`` is the KV pool as a flat uint8 buffer (numpy array or anything with the buffer
    protocol). Both sides compute it over the same logical bytes: the sender over its source runs, the
    receiver over its destination runs. xxh3 hashes at memory speed (> 10 GB/s), far above the wire."""
    h = xxhash.xxh3_64()
    for start, count in runs:
        h.update(pool_bytes[start * block_nbytes : (start + count) * block_nbytes])
    return h.intdigest()


# --------------------------------------------------------------------------------------------------------
# segments


def compute_segments(
    src_block_ids: Sequence[int], dst_block_ids: Sequence[int], num_dst_blocks: int
) -> list[Segment]:
    """Validate the local arguments of a fetch and merge them into runs where both src and dst ids are
    consecutive. Raises InvalidRequest."""
    if len(src_block_ids) != len(dst_block_ids):
        raise InvalidRequest(
            f"src_block_ids ({len(src_block_ids)}) and dst_block_ids ({len(dst_block_ids)}) differ in length"
        )
    seen: set[int] = set()
    for d in dst_block_ids:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < num_dst_blocks:
            raise InvalidRequest(f"destination block id {d!r} out of range [0, {num_dst_blocks})")
        if d in seen:
            raise InvalidRequest(f"destination block id {d} appears twice")
        seen.add(d)
    for s in src_block_ids:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0 or s >= 2**32:
            raise InvalidRequest(f"source block id {s!r} out of range")
    segments: list[Segment] = []
    for s, d in zip(src_block_ids, dst_block_ids):
        if segments:
            s0, d0, n = segments[-1]
            if s == s0 + n and d == d0 + n:
                segments[-1] = (s0, d0, n + 1)
                continue
        segments.append((s, d, 1))
    return segments


# --------------------------------------------------------------------------------------------------------
# endpoints


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> (host, port). Raises InvalidRequest."""
    host, sep, port_s = str(endpoint).rpartition(":")
    if not sep or not host:
        raise InvalidRequest(f"bad KV endpoint {endpoint!r}: expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError:
        raise InvalidRequest(f"bad KV endpoint {endpoint!r}: port is not a number") from None
    if not 0 < port < 65536:
        raise InvalidRequest(f"bad KV endpoint {endpoint!r}: port out of range")
    return host, port


_WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}


def advertise_host(host: str) -> str:
    """The host to put in the advertised endpoint: never a wildcard address."""
    if host not in _WILDCARDS:
        return host
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    logger.warning("KV sender host %r is a wildcard; advertising %s instead", host, addr)
    return addr


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------------------------------------------
# registrations


@dataclass
class Registration:
    transfer_id: str
    blocks: frozenset[int]
    on_done: OnDone


class TransferTable:
    """Registered transfers of one sender (thread-safe).

    A fetch *claims* a registration: from then on it is no longer registered (a second fetch gets
    NOT_FOUND, ``unregister`` returns False) and the claimer must call :meth:`finish` exactly once.
    """

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._lock = threading.Lock()
        self._regs: dict[str, Registration] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._regs)

    def register(self, transfer_id: str, block_ids: Sequence[int], on_done: OnDone) -> None:
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError("transfer_id must be a non-empty string")
        if len(transfer_id.encode()) > 1024:
            raise ValueError("transfer_id longer than 1024 bytes")
        if not callable(on_done):
            raise TypeError("on_done must be callable")
        blocks = frozenset(int(b) for b in block_ids)
        bad = [b for b in blocks if not 0 <= b < self._num_blocks]
        if bad:
            raise ValueError(f"block ids {sorted(bad)[:8]} out of range [0, {self._num_blocks})")
        with self._lock:
            if transfer_id in self._regs:
                raise ValueError(f"transfer {transfer_id!r} is already registered")
            self._regs[transfer_id] = Registration(transfer_id, blocks, on_done)

    def unregister(self, transfer_id: str) -> bool:
        with self._lock:
            return self._regs.pop(transfer_id, None) is not None

    def claim(
        self, transfer_id: str, src_runs: Sequence[tuple[int, int]]
    ) -> tuple[Status, Registration | None, str]:
        """Check that every block of ``src_runs`` [(start, count)] is registered under ``transfer_id``;
        if so remove the registration and return it with OK."""
        with self._lock:
            reg = self._regs.get(transfer_id)
            if reg is None:
                return Status.NOT_FOUND, None, f"no KV registered under transfer {transfer_id!r}"
            for start, count in src_runs:
                if count <= 0:
                    return Status.INVALID, None, f"empty segment at block {start}"
                for b in range(start, start + count):
                    if b not in reg.blocks:
                        return Status.INVALID, None, f"block {b} is not registered for transfer {transfer_id!r}"
            del self._regs[transfer_id]
            return Status.OK, reg, ""

    def drain(self) -> list[Registration]:
        """Remove and return all registrations (used by close)."""
        with self._lock:
            regs = list(self._regs.values())
            self._regs.clear()
            return regs


def call_on_done(reg: Registration, ok: bool) -> None:
    """Invoke a registration's callback, never letting its exception escape into the transport."""
    try:
        reg.on_done(reg.transfer_id, ok)
    except Exception:
        logger.exception("on_done callback for transfer %r raised", reg.transfer_id)
