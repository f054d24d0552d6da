"""Conversions between pd.v1 protobuf messages and splitserve's dataclasses."""

from __future__ import annotations

from pd.v1 import common_pb2

from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest
from splitserve.transfer.layout import KVLayout

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def sampling_fields(msg: common_pb2.SamplingParams, default_max_tokens: int | None) -> dict:
    """The proto's sampling fields as keyword arguments, with its defaults for unset optional fields
    (``max_tokens``: ``default_max_tokens``; top_p 1.0; seed None). Shared by the workers and the gRPC front door."""
    return dict(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int | None = None) -> SamplingParams:
    """Raises InvalidRequest on out-of-range values, and when ``max_tokens`` is unset and there is no
    ``default_max_tokens`` (workers: the router always sets it)."""
    if not msg.HasField("max_tokens") and default_max_tokens is None:
        raise InvalidRequest("sampling.max_tokens is required")
    try:
        return SamplingParams(**sampling_fields(msg, default_max_tokens))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        model_id=layout.model_id,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
    )


def layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    return KVLayout(msg.model_id, msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, msg.dtype)
