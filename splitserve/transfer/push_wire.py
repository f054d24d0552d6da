"""Binary messages of the UCX KV push protocol (little endian, no pickle; see :mod:`splitserve.transfer.push`).

SUBSCRIBE (decode -> prefill's KV sender, one UCX active message on the same connection as FETCH)::

    magic "SKP1" | kind u16 (=2) | flags u16 | tag_base u64 | block_nbytes u64 | layout_digest u64
    | num_blocks u32 | layer_groups u32 | bid_len u16 | reserved u16 | bootstrap_id (utf-8)
    [ | ctx_len u16 | trace context (ascii) ]     -- only with flag FLAG_TRACE_CONTEXT

``flags`` FLAG_CHECKSUM asks for an xxh3-64 of the source blocks in the completion. Data: layer group ``j`` of
destination block ``i`` travels as one tag message on ``tag_base + 1 + j * num_blocks + i``.

PUSH STATUS (prefill -> decode, one tag message on ``tag_base``, after every data message was posted)::

    magic "SKC1" | status u32 | flags u32 (1: finished at prefill, 2: checksum set) | checksum u64
    | num_tokens u32 | detail_len u32 | num_tokens x first token u32 | detail (utf-8)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from splitserve.transfer import wire
from splitserve.transfer.common import Status
from splitserve.transfer.push import MAX_CHOICES

SUBSCRIBE_MAGIC = b"SKP1"
PUSH_STATUS_MAGIC = b"SKC1"
KIND_SUBSCRIBE = 2
STATUS_FINISHED = 0x1
STATUS_CHECKSUM = 0x2

_SUB_HDR = struct.Struct("<4sHHQQQIIHH")
_STATUS_HDR = struct.Struct("<4sIIQII")
_CTX_LEN = struct.Struct("<H")
MAX_DETAIL = 512
#: receive buffer of a PUSH STATUS
PUSH_STATUS_NBYTES = _STATUS_HDR.size + 4 * MAX_CHOICES + MAX_DETAIL


@dataclass(frozen=True)
class SubscribeRequest:
    tag_base: int
    block_nbytes: int
    layout_digest: int
    bootstrap_id: str
    num_blocks: int
    layer_groups: int
    trace_context: str = ""
    flags: int = 0  # wire.FLAG_CHECKSUM


@dataclass(frozen=True)
class PushStatus:
    status: Status
    finished: bool
    checksum: int | None
    first_token_ids: tuple[int, ...]
    detail: str


def encode_subscribe(req: SubscribeRequest) -> bytearray:
    bid = req.bootstrap_id.encode()
    if not bid or len(bid) > wire.MAX_TID_BYTES:
        raise wire.WireError("bad bootstrap id")
    ctx = req.trace_context.encode("ascii", errors="replace")
    if len(ctx) > wire.MAX_TRACE_CONTEXT_BYTES:
        ctx = b""
    flags = (wire.FLAG_TRACE_CONTEXT if ctx else 0) | (req.flags & wire.FLAG_CHECKSUM)
    out = bytearray(_SUB_HDR.pack(SUBSCRIBE_MAGIC, KIND_SUBSCRIBE, flags, req.tag_base, req.block_nbytes,
                                  req.layout_digest, req.num_blocks, req.layer_groups, len(bid), 0))
    out += bid
    if ctx:
        out += _CTX_LEN.pack(len(ctx)) + ctx
    return out


def decode_subscribe(buf) -> SubscribeRequest:
    mv = memoryview(buf).cast("B")
    if len(mv) < _SUB_HDR.size:
        raise wire.WireError("short subscribe header")
    magic, kind, flags, tag_base, bn, digest, nblocks, groups, bid_len, _r = _SUB_HDR.unpack_from(mv, 0)
    if magic != SUBSCRIBE_MAGIC or kind != KIND_SUBSCRIBE:
        raise wire.WireError("not a subscribe request")
    if bid_len == 0 or bid_len > wire.MAX_TID_BYTES or nblocks == 0 or (groups + 1) * nblocks > wire.MAX_SEGMENTS:
        raise wire.WireError("subscribe request out of range")
    end = _SUB_HDR.size + bid_len
    ctx = ""
    if flags & wire.FLAG_TRACE_CONTEXT:
        if len(mv) < end + _CTX_LEN.size:
            raise wire.WireError("subscribe request length mismatch")
        (n,) = _CTX_LEN.unpack_from(mv, end)
        if n > wire.MAX_TRACE_CONTEXT_BYTES or len(mv) != end + _CTX_LEN.size + n:
            raise wire.WireError("subscribe request length mismatch")
        ctx = bytes(mv[end + _CTX_LEN.size:]).decode("ascii", errors="replace")
    elif len(mv) != end:
        raise wire.WireError("subscribe request length mismatch")
    try:
        bid = bytes(mv[_SUB_HDR.size:end]).decode()
    except UnicodeDecodeError:
        raise wire.WireError("bootstrap id is not utf-8") from None
    return SubscribeRequest(tag_base, bn, digest, bid, nblocks, groups, ctx, flags & wire.FLAG_CHECKSUM)


def decode_request(buf) -> wire.FetchRequest | SubscribeRequest:
    """A FETCH or a SUBSCRIBE, by its magic (the KV sender's connections carry both)."""
    if bytes(memoryview(buf).cast("B")[:4]) == SUBSCRIBE_MAGIC:
        return decode_subscribe(buf)
    return wire.decode_fetch(buf)


def encode_push_status(status: Status, first_token_ids: list[int] = (), finished: bool = False,
                       checksum: int | None = None, detail: str = "") -> bytearray:
    toks = list(first_token_ids)[:MAX_CHOICES]
    d = detail.encode()[:MAX_DETAIL]
    flags = (STATUS_FINISHED if finished else 0) | (STATUS_CHECKSUM if checksum is not None else 0)
    out = bytearray(_STATUS_HDR.pack(PUSH_STATUS_MAGIC, int(status), flags, checksum or 0, len(toks), len(d)))
    out += struct.pack(f"<{len(toks)}I", *toks) + d
    return out


def decode_push_status(buf) -> PushStatus:
    mv = memoryview(buf).cast("B")
    magic, code, flags, checksum, ntok, dlen = _STATUS_HDR.unpack_from(mv, 0)
    if magic != PUSH_STATUS_MAGIC or ntok > MAX_CHOICES or dlen > MAX_DETAIL:
        raise wire.WireError("not a push status message")
    try:
        status = Status(code)
    except ValueError:
        raise wire.WireError(f"unknown status code {code}") from None
    off = _STATUS_HDR.size
    toks = struct.unpack_from(f"<{ntok}I", mv, off)
    detail = bytes(mv[off + 4 * ntok: off + 4 * ntok + dlen]).decode(errors="replace")
    return PushStatus(status, bool(flags & STATUS_FINISHED), checksum if flags & STATUS_CHECKSUM else None, toks, detail)
