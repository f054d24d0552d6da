"""Binary control messages of the UCX KV pull protocol (little endian, no pickle: peers are not trusted).

FETCH request (receiver -> sender, one UCX active message)::

    magic "SKV1" | kind u16 (=1) | flags u16 | tag_base u64 | block_nbytes u64 | layout_digest u64
    | nseg u32 | tid_len u16 | tail_rows u16 | transfer_id (utf-8, tid_len bytes) | nseg x (src_start u32, count u32)
    [ | head_rows u16 ]                                            -- only with flag FLAG_PARTIAL_HEAD
    [ | ctx_len u16 | trace context (ascii, ctx_len bytes) ]     -- only with flag FLAG_TRACE_CONTEXT

The trace context is the receiver's W3C ``traceparent`` (see :mod:`splitserve.telemetry.propagation`),
so the sender's transfer span joins the request's trace. It is sent only when there is one, so with
tracing off the message is byte-for-byte the original format.

``flags`` bit 1 (:data:`FLAG_CHECKSUM`): the receiver asks for a checksum of the data it will receive.

``flags`` bit 2 (:data:`FLAG_PARTIAL_TAIL`): the last segment is one block (count 1) of which only token rows
``[0, tail_rows)`` move, packed (:mod:`splitserve.transfer.partial_block`): ``tail_rows`` tokens' KV bytes
instead of a whole block. Without the flag ``tail_rows`` is 0 and every segment moves whole blocks.

``flags`` bit 3 (:data:`FLAG_PARTIAL_HEAD`): the first segment is one block (count 1) of which the receiver already
holds token rows ``[0, head_rows)``: only rows ``[head_rows, block_size)`` move, packed (``[head_rows, tail_rows)``
when that block is also the partial last one). Without the flag the message has no ``head_rows`` field.

STATUS reply (sender -> receiver, one tag message on ``tag_base``)::

    magic "SKS1" | status u32 | detail_len u32 | detail (utf-8)
    magic "SKS2" | status u32 | detail_len u32 | checksum u64 | detail     (when FLAG_CHECKSUM was set)

``checksum``: xxh3-64 over the bytes of every segment as they travel (a partial block: its packed rows), in
segment order, computed by the sender from its KV blocks before posting them
(:func:`splitserve.transfer.partial_block.parts_checksum`).

Data: segment ``i`` travels as one tag message on ``tag_base + 1 + i``.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass

from splitserve.transfer.common import Status

FETCH_MAGIC = b"SKV1"
STATUS_MAGIC = b"SKS1"
STATUS_CHECKSUM_MAGIC = b"SKS2"
KIND_FETCH = 1
FLAG_TRACE_CONTEXT = 0x1
FLAG_CHECKSUM = 0x2
FLAG_PARTIAL_TAIL = 0x4
FLAG_PARTIAL_HEAD = 0x8
MAX_TRACE_CONTEXT_BYTES = 512

_FETCH_HDR = struct.Struct("<4sHHQQQIHH")
_STATUS_HDR = struct.Struct("<4sII")
_CHECKSUM = struct.Struct("<Q")
_CTX_LEN = struct.Struct("<H")
_HEAD_ROWS = struct.Struct("<H")

#: receive buffer for a STATUS message; details are truncated to fit
STATUS_BUF_NBYTES = 1024
MAX_DETAIL = STATUS_BUF_NBYTES - _STATUS_HDR.size - _CHECKSUM.size
#: segments per transfer are numbered in the low bits of the tag
MAX_SEGMENTS = (1 << 24) - 2
MAX_TID_BYTES = 1024


class WireError(ValueError):
    """A control message could not be decoded."""


@dataclass(frozen=True)
class FetchRequest:
    tag_base: int
    block_nbytes: int
    layout_digest: int
    transfer_id: str
    runs: list[tuple[int, int]]  # (src_start, count) per segment, in tag order
    trace_context: str = ""  # W3C traceparent of the receiver's span, "" for none
    flags: int = 0  # FLAG_CHECKSUM (FLAG_TRACE_CONTEXT and FLAG_PARTIAL_TAIL are set by encode_fetch)
    tail_rows: int = 0  # > 0: the last run is one block of which rows [0, tail_rows) move (FLAG_PARTIAL_TAIL)
    head_rows: int = 0  # > 0: the first run is one block of which rows [head_rows, ...) move (FLAG_PARTIAL_HEAD)


def encode_fetch(req: FetchRequest) -> bytearray:
    tid = req.transfer_id.encode()
    if len(tid) > MAX_TID_BYTES:
        raise WireError("transfer id too long")
    if len(req.runs) > MAX_SEGMENTS:
        raise WireError("too many segments")
    ctx = req.trace_context.encode("ascii", errors="replace")
    if len(ctx) > MAX_TRACE_CONTEXT_BYTES:
        ctx = b""  # never fail a transfer over tracing
    flags = FLAG_TRACE_CONTEXT if ctx else 0
    if not 0 <= req.tail_rows < 1 << 16:
        raise WireError("tail_rows out of range")
    if req.tail_rows:
        if not req.runs or req.runs[-1][1] != 1:
            raise WireError("a partial tail must be the last run, of one block")
        flags |= FLAG_PARTIAL_TAIL
    if not 0 <= req.head_rows < 1 << 16:
        raise WireError("head_rows out of range")
    if req.head_rows:
        _check_head(req.runs, req.head_rows, req.tail_rows)
        flags |= FLAG_PARTIAL_HEAD
    flat = array("I")
    for start, count in req.runs:
        flat.append(start)
        flat.append(count)
    if sys.byteorder != "little":  # pragma: no cover
        flat.byteswap()
    out = bytearray(
        _FETCH_HDR.pack(
            FETCH_MAGIC, KIND_FETCH, flags | (req.flags & FLAG_CHECKSUM), req.tag_base, req.block_nbytes, req.layout_digest, len(req.runs),
            len(tid), req.tail_rows
        )
    )
    out += tid
    out += flat.tobytes()
    if req.head_rows:
        out += _HEAD_ROWS.pack(req.head_rows)
    if ctx:
        out += _CTX_LEN.pack(len(ctx)) + ctx
    return out


def decode_fetch(buf) -> FetchRequest:
    mv = memoryview(buf).cast("B")
    if len(mv) < _FETCH_HDR.size:
        raise WireError("short fetch header")
    magic, kind, flags, tag_base, block_nbytes, digest, nseg, tid_len, tail_rows = _FETCH_HDR.unpack_from(mv, 0)
    if magic != FETCH_MAGIC or kind != KIND_FETCH:
        raise WireError("not a fetch request")
    if nseg > MAX_SEGMENTS or tid_len > MAX_TID_BYTES:
        raise WireError("fetch request too large")
    off = _FETCH_HDR.size
    end = off + tid_len + 8 * nseg
    runs_end = end
    head_rows = 0
    if flags & FLAG_PARTIAL_HEAD:
        if len(mv) < end + _HEAD_ROWS.size:
            raise WireError("fetch request length mismatch")
        (head_rows,) = _HEAD_ROWS.unpack_from(mv, end)
        end += _HEAD_ROWS.size
    ctx = ""
    if flags & FLAG_TRACE_CONTEXT:
        if len(mv) < end + _CTX_LEN.size:
            raise WireError("fetch request length mismatch")
        (ctx_len,) = _CTX_LEN.unpack_from(mv, end)
        if ctx_len > MAX_TRACE_CONTEXT_BYTES or len(mv) != end + _CTX_LEN.size + ctx_len:
            raise WireError("fetch request length mismatch")
        try:
            ctx = bytes(mv[end + _CTX_LEN.size :]).decode("ascii")
        except UnicodeDecodeError:
            raise WireError("trace context is not ascii") from None
    elif len(mv) != end:
        raise WireError("fetch request length mismatch")
    try:
        tid = bytes(mv[off : off + tid_len]).decode()
    except UnicodeDecodeError:
        raise WireError("transfer id is not utf-8") from None
    off += tid_len
    flat = array("I")
    flat.frombytes(bytes(mv[off:runs_end]))
    if sys.byteorder != "little":  # pragma: no cover
        flat.byteswap()
    runs = [(flat[2 * i], flat[2 * i + 1]) for i in range(nseg)]
    if not flags & FLAG_PARTIAL_TAIL:
        tail_rows = 0
    elif tail_rows == 0 or not runs or runs[-1][1] != 1:
        raise WireError("bad partial tail")
    if flags & FLAG_PARTIAL_HEAD:
        _check_head(runs, head_rows, tail_rows)
    return FetchRequest(tag_base, block_nbytes, digest, tid, runs, ctx, flags & FLAG_CHECKSUM, tail_rows, head_rows)


def _check_head(runs: list[tuple[int, int]], head_rows: int, tail_rows: int) -> None:
    """A partly held first block: its own run of one block, with rows left to move (WireError otherwise)."""
    if head_rows == 0 or not runs or runs[0][1] != 1:
        raise WireError("a partly held first block must be the first run, of one block")
    if len(runs) == 1 and tail_rows and head_rows >= tail_rows:
        raise WireError("a partly held block with no rows left to move")


def encode_status(status: Status, detail: str = "", checksum: int | None = None) -> bytearray:
    d = detail.encode()[:MAX_DETAIL]
    if checksum is None:
        return bytearray(_STATUS_HDR.pack(STATUS_MAGIC, int(status), len(d)) + d)
    return bytearray(_STATUS_HDR.pack(STATUS_CHECKSUM_MAGIC, int(status), len(d)) + _CHECKSUM.pack(checksum) + d)


def decode_status_checksum(buf) -> tuple[Status, str, int | None]:
    """(status, detail, checksum or None when the sender sent none)."""
    mv = memoryview(buf).cast("B")
    magic, code, dlen = _STATUS_HDR.unpack_from(mv, 0)
    if magic not in (STATUS_MAGIC, STATUS_CHECKSUM_MAGIC):
        raise WireError("not a status message")
    try:
        status = Status(code)
    except ValueError:
        raise WireError(f"unknown status code {code}") from None
    off = _STATUS_HDR.size
    checksum = None
    if magic == STATUS_CHECKSUM_MAGIC:
        (checksum,) = _CHECKSUM.unpack_from(mv, off)
        off += _CHECKSUM.size
    dlen = min(dlen, MAX_DETAIL)
    detail = bytes(mv[off : off + dlen]).decode(errors="replace")
    return status, detail, checksum


def decode_status(buf) -> tuple[Status, str]:
    status, detail, _checksum = decode_status_checksum(buf)
    return status, detail
