"""pd.v1 <-> dataclass conversions (splitserve.rpc.convert): every sampling field, guided specs and logprobs
round-trip exactly, through serialized bytes as a worker receives them."""

from __future__ import annotations

import math

import pytest
from pd.v1 import common_pb2

from splitserve.engine.guided_spec import GUIDED_KINDS, GuidedSpec
from splitserve.engine.logprobs import TokenLogprob
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest
from splitserve.rpc.convert import (
    extra_sampling_fields, guided_from_proto, guided_to_proto, logprob_from_proto, logprob_to_proto, logprobs_from_proto,
    logprobs_to_proto, prompt_logprobs_from_proto, prompt_logprobs_to_proto, sampling_from_proto, sampling_to_proto,
)

# temperature and top_p travel as float32: values exactly representable there round-trip exactly
EVERYTHING = SamplingParams(
    max_tokens=40, temperature=0.75, top_p=0.875, top_k=7, seed=2**62 + 3, stop_token_ids=(2, 9), ignore_eos=True,
    presence_penalty=0.3, frequency_penalty=-1.1, repetition_penalty=1.3, min_p=0.05, min_tokens=4,
    logit_bias=((17, 2.5), (3, -100.0), (17, 0.1)), bad_words_token_ids=((5,), (8, 9, 10)),
    allowed_token_ids=(1, 2, 3, 17), logprobs=5, prompt_logprobs=0, n=3,
    guided=GuidedSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
)


def _wire(msg):
    """``msg`` after serialization, as the peer parses it."""
    return type(msg).FromString(msg.SerializeToString())


@pytest.mark.parametrize("params", [
    EVERYTHING,
    SamplingParams(),
    SamplingParams(max_tokens=1, temperature=0.0, seed=0, logprobs=0, n=2, allowed_token_ids=(0,)),
    SamplingParams(repetition_penalty=0.5, prompt_logprobs=20, guided=GuidedSpec("json_object")),
], ids=["every-field", "defaults", "zeros", "misc"])
def test_sampling_params_round_trip_exactly(params):
    assert sampling_from_proto(_wire(sampling_to_proto(params))) == params


def test_defaults_leave_the_new_fields_unset_on_the_wire():
    msg = sampling_to_proto(SamplingParams())
    for name in ("repetition_penalty", "allowed_token_ids", "logprobs", "prompt_logprobs", "guided"):
        assert not msg.HasField(name), name
    assert msg.n == 0 and not msg.logit_bias and not msg.bad_words_token_ids


def test_presence_of_optional_fields_survives_zero_values():
    msg = _wire(sampling_to_proto(SamplingParams(logprobs=0, prompt_logprobs=0)))
    assert msg.HasField("logprobs") and msg.logprobs == 0 and msg.HasField("prompt_logprobs")
    assert extra_sampling_fields(msg)["logprobs"] == 0
    # an empty allowed set is present (and refused), not "no restriction"
    bad = common_pb2.SamplingParams(max_tokens=4)
    bad.allowed_token_ids.SetInParent()
    with pytest.raises(InvalidRequest, match="allowed_token_ids"):
        sampling_from_proto(bad)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("min_p", 1.5),
    ("min_tokens", 41), ("logprobs", 21), ("prompt_logprobs", 99), ("n", 1000),
])
def test_out_of_range_values_from_the_wire_are_invalid_request(field, value):
    msg = sampling_to_proto(SamplingParams(max_tokens=40))
    setattr(msg, field, value)
    with pytest.raises(InvalidRequest, match=field):
        sampling_from_proto(msg)


def test_logit_bias_out_of_range_is_invalid_request():
    msg = sampling_to_proto(SamplingParams(max_tokens=4))
    msg.logit_bias.add(token_id=1, bias=101.0)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        sampling_from_proto(msg)


@pytest.mark.parametrize("kind", GUIDED_KINDS)
def test_guided_spec_round_trips_every_kind(kind):
    spec = GuidedSpec(kind, "" if kind == "json_object" else f"spec of {kind} \u00e9")
    assert guided_from_proto(_wire(guided_to_proto(spec))) == spec


def test_unspecified_guided_kind_is_invalid_request():
    msg = common_pb2.SamplingParams(max_tokens=4)
    msg.guided.spec = "[a-z]+"
    with pytest.raises(InvalidRequest, match="guided.kind"):
        sampling_from_proto(msg)
    msg.guided.kind = 99  # a kind from a newer peer
    with pytest.raises(InvalidRequest, match="99"):
        sampling_from_proto(msg)


def test_token_logprob_round_trips_exactly():
    lps = [
        TokenLogprob(7, -0.123456789012345, 2, ((3, -0.01), (7, -0.123456789012345), (9, -7.5))),
        TokenLogprob(0, -math.inf, 50257, ()),
        TokenLogprob(2**31, 0.0, 1, ((2**31, 0.0),)),
    ]
    assert [logprob_from_proto(_wire(logprob_to_proto(lp))) for lp in lps] == lps
    assert logprobs_from_proto([_wire(m) for m in logprobs_to_proto(lps)], asked=True) == lps
    assert logprobs_from_proto(logprobs_to_proto(None), asked=False) is None
    assert logprobs_from_proto(logprobs_to_proto([]), asked=True) == []


def test_prompt_logprobs_keep_the_leading_none():
    pl = [None, TokenLogprob(5, -1.5, 3, ((1, -0.5),)), TokenLogprob(6, -0.25, 1, ((6, -0.25),))]
    msg = _wire(prompt_logprobs_to_proto(pl))
    assert msg.num_leading_none == 1 and len(msg.entries) == 2
    assert prompt_logprobs_from_proto(msg) == pl
    assert prompt_logprobs_from_proto(_wire(prompt_logprobs_to_proto([None]))) == [None]
    assert prompt_logprobs_from_proto(_wire(prompt_logprobs_to_proto([]))) == []
    with pytest.raises(ValueError, match="leading"):
        prompt_logprobs_to_proto([None, TokenLogprob(1, -1.0), None])
