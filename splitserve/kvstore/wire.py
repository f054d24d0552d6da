"""Binary messages of the KV store data plane (UCX, little endian, no pickle: peers are not trusted).

REQUEST (client -> storage node, one UCX active message)::

    magic "SKO1" | op u16 (1 = READ, 2 = WRITE) | flags u16 | req_id u64 | nseg u32 | reserved u32
    | nseg x (offset u64, nbytes u64)

STATUS (node -> client, tag message on ``tag(req_id, 0)``)::

    magic "SKR1" | status u32 | detail_len u32 | detail (utf-8)

Data: range ``i`` travels as one tag message on ``tag(req_id, 1 + i)``: node -> client for READ, client ->
node for WRITE. Tags are *not* forced: ucxx hashes them with the endpoint's own tag, so they only need to
be unique per connection (the client numbers its requests).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

REQUEST_MAGIC = b"SKO1"
STATUS_MAGIC = b"SKR1"

_REQ_HDR = struct.Struct("<4sHHQII")
_RANGE = struct.Struct("<QQ")
_STATUS_HDR = struct.Struct("<4sII")

STATUS_BUF_NBYTES = 512
MAX_DETAIL = STATUS_BUF_NBYTES - _STATUS_HDR.size
MAX_RANGES = (1 << 16) - 2
_REQ_ID_LIMIT = 1 << 44


class Op(enum.IntEnum):
    READ = 1
    WRITE = 2


class Status(enum.IntEnum):
    OK = 0
    INVALID = 1  # a range outside the segment, an empty range, too many ranges
    CLOSING = 2  # the node is shutting down
    FAILED = 3  # the node could not complete the write (timeout, connection error)


class WireError(ValueError):
    """A data-plane message could not be decoded."""


@dataclass(frozen=True)
class Request:
    op: Op
    req_id: int
    ranges: list[tuple[int, int]]  # (offset, nbytes) in the node's segment, in tag order


def tag(req_id: int, index: int) -> int:
    """Tag of message ``index`` of request ``req_id`` (0 = STATUS, 1 + i = range i)."""
    return (req_id << 16) | index


def encode_request(req: Request) -> bytearray:
    if not 0 < len(req.ranges) <= MAX_RANGES:
        raise WireError(f"a request carries 1..{MAX_RANGES} ranges, got {len(req.ranges)}")
    if not 0 <= req.req_id < _REQ_ID_LIMIT:
        raise WireError("request id out of range")
    out = bytearray(_REQ_HDR.pack(REQUEST_MAGIC, int(req.op), 0, req.req_id, len(req.ranges), 0))
    for offset, nbytes in req.ranges:
        out += _RANGE.pack(offset, nbytes)
    return out


def decode_request(buf) -> Request:
    mv = memoryview(buf).cast("B")
    if len(mv) < _REQ_HDR.size:
        raise WireError("short request header")
    magic, op, _flags, req_id, nseg, _r = _REQ_HDR.unpack_from(mv, 0)
    if magic != REQUEST_MAGIC:
        raise WireError("not a store request")
    try:
        op = Op(op)
    except ValueError:
        raise WireError(f"unknown op {op}") from None
    if not 0 < nseg <= MAX_RANGES or req_id >= _REQ_ID_LIMIT:
        raise WireError("bad range count or request id")
    if len(mv) != _REQ_HDR.size + nseg * _RANGE.size:
        raise WireError("request length mismatch")
    ranges = [_RANGE.unpack_from(mv, _REQ_HDR.size + i * _RANGE.size) for i in range(nseg)]
    return Request(op, req_id, ranges)


def encode_status(status: Status, detail: str = "") -> bytearray:
    d = detail.encode()[:MAX_DETAIL]
    return bytearray(_STATUS_HDR.pack(STATUS_MAGIC, int(status), len(d)) + d)


def decode_status(buf) -> tuple[Status, str]:
    mv = memoryview(buf).cast("B")
    if len(mv) < _STATUS_HDR.size:
        raise WireError("short status message")
    magic, code, dlen = _STATUS_HDR.unpack_from(mv, 0)
    if magic != STATUS_MAGIC:
        raise WireError("not a status message")
    try:
        status = Status(code)
    except ValueError:
        raise WireError(f"unknown status {code}") from None
    dlen = min(dlen, MAX_DETAIL)
    return status, bytes(mv[_STATUS_HDR.size : _STATUS_HDR.size + dlen]).decode(errors="replace")


def check_ranges(ranges: list[tuple[int, int]], segment_nbytes: int) -> str:
    """Empty string if every range is non-empty and inside the segment, else why not."""
    for offset, nbytes in ranges:
        if nbytes < 1 or offset + nbytes > segment_nbytes:
            return f"range [{offset}, {offset + nbytes}) is empty or outside the segment of {segment_nbytes} bytes"
    return ""
