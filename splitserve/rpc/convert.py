"""Conversions between pd.v1 protobuf messages and splitserve's dataclasses.

Sampling parameters round-trip exactly (``sampling_from_proto(sampling_to_proto(p)) == p``) except ``temperature``
and ``top_p``, which the wire carries as float32 (field types of pd.v1 never change); every worker sees the same
float32 values. Logprobs round-trip exactly (doubles on the wire).
"""

from __future__ import annotations

from collections.abc import Sequence

from pd.v1 import common_pb2

from splitserve.engine.guided_spec import GuidedSpec
from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
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

GUIDED_TO_PROTO = {
    "json_schema": common_pb2.GUIDED_KIND_JSON_SCHEMA,
    "json_object": common_pb2.GUIDED_KIND_JSON_OBJECT,
    "regex": common_pb2.GUIDED_KIND_REGEX,
    "choice": common_pb2.GUIDED_KIND_CHOICE,
    "grammar": common_pb2.GUIDED_KIND_GRAMMAR,
}
GUIDED_FROM_PROTO = {v: k for k, v in GUIDED_TO_PROTO.items()}


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """Every field of ``p`` (defaults left unset on the wire)."""
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        logit_bias=[common_pb2.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias],
        bad_words_token_ids=[common_pb2.TokenIdSequence(ids=list(w)) for w in p.bad_words_token_ids],
        n=p.n if p.n != 1 else 0,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.allowed_token_ids is not None:
        msg.allowed_token_ids.ids.extend(p.allowed_token_ids)
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.guided is not None:
        msg.guided.CopyFrom(guided_to_proto(p.guided))
    return msg


def guided_to_proto(g: GuidedSpec) -> common_pb2.GuidedSpec:
    return common_pb2.GuidedSpec(kind=GUIDED_TO_PROTO[g.kind], spec=g.spec)


def guided_from_proto(msg: common_pb2.GuidedSpec) -> GuidedSpec:
    """Raises InvalidRequest for GUIDED_KIND_UNSPECIFIED or a kind this build does not know."""
    kind = GUIDED_FROM_PROTO.get(msg.kind)
    if kind is None:
        raise InvalidRequest(f"sampling.guided.kind must be one of {sorted(GUIDED_TO_PROTO)}, got enum value {msg.kind}")
    return GuidedSpec(kind, msg.spec)


def sampling_fields(msg: common_pb2.SamplingParams, default_max_tokens: int | None) -> dict:
    """The proto's basic sampling fields (max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos) as
    keyword arguments, with its defaults for unset optional fields (``max_tokens``: ``default_max_tokens``; top_p 1.0;
    seed None). Shared by the workers and the gRPC front door; the rest: :func:`extra_sampling_fields`."""
    return dict(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def extra_sampling_fields(msg: common_pb2.SamplingParams) -> dict:
    """The proto's fields beyond :func:`sampling_fields` (penalties, min_p, min_tokens, logit_bias, bad words,
    allowed token ids, logprobs, prompt_logprobs, n, guided) as keyword arguments of :class:`SamplingParams`, unset
    ones at its defaults. Raises InvalidRequest for an unknown guided kind."""
    return dict(
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        min_p=msg.min_p,
        min_tokens=msg.min_tokens,
        logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias),
        bad_words_token_ids=tuple(tuple(w.ids) for w in msg.bad_words_token_ids),
        allowed_token_ids=tuple(msg.allowed_token_ids.ids) if msg.HasField("allowed_token_ids") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        n=msg.n or 1,
        guided=guided_from_proto(msg.guided) if msg.HasField("guided") else None,
    )


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int | None = None) -> SamplingParams:
    """All of the proto's fields. Raises InvalidRequest on out-of-range values, and when ``max_tokens`` is unset
    and there is no ``default_max_tokens`` (workers: the router always sets it)."""
    if not msg.HasField("max_tokens") and default_max_tokens is None:
        raise InvalidRequest("sampling.max_tokens is required")
    try:
        return SamplingParams(**sampling_fields(msg, default_max_tokens), **extra_sampling_fields(msg))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top))


def logprobs_to_proto(lps: Sequence[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    """``None`` (not asked for) and ``[]`` both become no entries."""
    return [logprob_to_proto(lp) for lp in lps or ()]


def logprobs_from_proto(msgs: Sequence[common_pb2.TokenLogprob], asked: bool) -> list[TokenLogprob] | None:
    """The entries, or None when the request did not ask for logprobs (``asked``)."""
    return [logprob_from_proto(m) for m in msgs] if asked else None


def prompt_logprobs_to_proto(pl: PromptLogprobs) -> common_pb2.PromptLogprobs:
    """Raises ValueError when a None entry follows a TokenLogprob (only leading Nones have a wire form)."""
    lead = 0
    while lead < len(pl) and pl[lead] is None:
        lead += 1
    rest = pl[lead:]
    if any(e is None for e in rest):
        raise ValueError("prompt logprobs: only leading entries may be None")
    return common_pb2.PromptLogprobs(num_leading_none=lead, entries=[logprob_to_proto(e) for e in rest])


def prompt_logprobs_from_proto(msg: common_pb2.PromptLogprobs) -> PromptLogprobs:
    return [None] * msg.num_leading_none + [logprob_from_proto(e) for e in msg.entries]


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        model_id=layout.model_id,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        device=layout.device,
    )


def layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    return KVLayout(msg.model_id, msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, msg.dtype, msg.device)
