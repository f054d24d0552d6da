"""Structured outputs (splitserve.engine.guided): sampling under the matcher's mask always yields valid text.

Two sources of logits: seeded random logits over a padded vocabulary (cheap; many JSON schemas), and the real
stories260K model (its 512-token vocabulary has byte-fallback tokens, so it can write JSON; TinyStories-656K has
no '{' token and cannot). Every output is checked with an independent validator: jsonschema, re.fullmatch, set
membership.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from splitserve.engine.guided import make_matcher, tokenizer_index
from splitserve.engine.guided_spec import GuidedSpec
from splitserve.errors import InvalidRequest
from splitserve.model import load_model
from splitserve.model.attention import AttentionMetadata

MODELS = Path(__file__).resolve().parents[1] / "models"
PADDED_VOCAB = 520  # stories260K's tokenizer has 512 tokens: 8 padding rows must never be allowed

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}, "required": ["kind", "r"],
     "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
               {"type": "object", "properties": {"b": {"type": "string", "maxLength": 4}}, "required": ["b"], "additionalProperties": False}]},
    {"$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["id"],
                        "additionalProperties": False}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"type": ["string", "null"], "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["status", "n"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def gguf():
    return load_model(MODELS / "stories260K.gguf")


def sample_random(spec: GuidedSpec, tok, eos: tuple[int, ...], seed: int, max_steps: int = 400,
                  boost: tuple[int, ...] = ()) -> tuple[list[int], object]:
    """Draw from softmax(random logits + 6 on ``boost`` ids) under the mask until EOS; asserts padding rows are never allowed."""
    m = make_matcher(spec, tok, PADDED_VOCAB, eos)
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        mask = torch.ones(PADDED_VOCAB, dtype=torch.bool)
        m.fill_mask(mask)
        assert not mask[512:].any(), "a padding row was allowed"
        logits = torch.randn(PADDED_VOCAB, generator=g) * 3
        logits[list(boost)] += 6
        logits = logits.masked_fill(~mask, float("-inf"))
        t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        assert m.accept(t), f"the matcher refused token {t} its own mask allowed"
        if t in eos:
            return out, m
        out.append(t)
    raise AssertionError(f"no EOS within {max_steps} tokens: {tok.decode(out)!r}")


def sample_model(lm, spec: GuidedSpec, prompt: str, max_steps: int, temperature: float = 0.0, seed: int = 0) -> str:
    """Greedy (or seeded) decoding with the real model, one token per forward, logits masked by the matcher."""
    tok, bs, nb = lm.tokenizer, 16, 16
    m = make_matcher(spec, tok, lm.config.vocab_size, lm.eos_token_ids)
    cache = lm.model.allocate_kv_cache(nb, bs)
    g = torch.Generator().manual_seed(seed)
    new, pos, out = tok.encode(prompt), 0, []
    for _ in range(max_steps):
        n = len(new)
        attn = AttentionMetadata(torch.arange(pos, pos + n), [n], [pos + n], [list(range(nb))], bs)
        logits = lm.model(torch.tensor(new), torch.arange(pos, pos + n), cache, attn)[0]
        pos += n
        mask = torch.ones(lm.config.vocab_size, dtype=torch.bool)
        m.fill_mask(mask)
        logits = logits.masked_fill(~mask, float("-inf"))
        if temperature == 0:
            t = int(logits.argmax())
        else:
            t = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
        assert m.accept(t)
        if t in lm.eos_token_ids:
            assert m.is_terminated()
            return tok.decode(out)
        out.append(t)
        new = [t]
    raise AssertionError(f"no EOS within {max_steps} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_random_logits_validate(gguf, i):
    schema = SCHEMAS[i]
    spec = GuidedSpec("json_schema", json.dumps(schema))
    for seed in range(3):
        ids, m = sample_random(spec, gguf.tokenizer, gguf.eos_token_ids, seed)
        text = gguf.tokenizer.decode(ids)
        jsonschema.validate(json.loads(text), schema)
        assert m.is_terminated()


def test_json_object_random_logits(gguf):
    closing = tuple(gguf.tokenizer.hf.token_to_id(t) for t in ('"', "<0x7D>"))  # unbounded strings end sooner
    for seed in range(3):
        ids, _ = sample_random(GuidedSpec("json_object"), gguf.tokenizer, gguf.eos_token_ids, seed, 1000, closing)
        assert isinstance(json.loads(gguf.tokenizer.decode(ids)), dict)


def test_regex_choice_grammar_random_logits(gguf):
    tok, eos = gguf.tokenizer, gguf.eos_token_ids
    pattern = r"(cat|dog)-[0-9]{2,4}(\.[a-z]{1,3})?"
    choices = ["yes", "no", "maybe not", "Zürich"]
    for seed in range(4):
        assert re.fullmatch(pattern, tok.decode(sample_random(GuidedSpec("regex", pattern), tok, eos, seed)[0]))
        assert tok.decode(sample_random(GuidedSpec("choice", json.dumps(choices)), tok, eos, seed)[0]) in choices
        lark = 'start: greeting " " name "!"\ngreeting: "Hello" | "Hi"\nname: /[A-Z][a-z]{1,5}/'
        assert re.fullmatch(r"(Hello|Hi) [A-Z][a-z]{1,5}!", tok.decode(sample_random(GuidedSpec("grammar", lark), tok, eos, seed)[0]))
        gbnf = 'root ::= "x=" [0-9] [0-9]? ";"'
        assert re.fullmatch(r"x=[0-9][0-9]?;", tok.decode(sample_random(GuidedSpec("grammar", gbnf), tok, eos, seed)[0]))


@pytest.mark.slow
def test_real_model_greedy_and_seeded(gguf):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "mood": {"enum": ["happy", "sad"]}},
              "required": ["name", "mood"], "additionalProperties": False}
    for temperature in (0.0, 1.0):
        text = sample_model(gguf, GuidedSpec("json_schema", json.dumps(schema)), "Once upon a time", 40, temperature)
        jsonschema.validate(json.loads(text), schema)
        text = sample_model(gguf, GuidedSpec("regex", r"[A-Z][a-z]+ (is|was) [0-9]{1,2} years old\."), "Lily", 30, temperature)
        assert re.fullmatch(r"[A-Z][a-z]+ (is|was) [0-9]{1,2} years old\.", text)
        assert sample_model(gguf, GuidedSpec("choice", '["happy", "sad", "angry"]'), "She was", 10, temperature) in ("happy", "sad", "angry")


def test_tinystories_656k_regex_and_choice():
    lm = load_model(MODELS / "TinyStories-656K")
    text = sample_model(lm, GuidedSpec("regex", r"[A-Z][a-z]+ (is|was) [0-9]{1,2} years old\."), "Once upon a time", 30)
    assert re.fullmatch(r"[A-Z][a-z]+ (is|was) [0-9]{1,2} years old\.", text)
    assert sample_model(lm, GuidedSpec("choice", '["cat", "dog"]'), "The", 10) in ("cat", "dog")


def test_vocabulary_without_braces_cannot_write_json():
    tok = load_model(MODELS / "TinyStories-656K", weights=False).tokenizer  # no '{' token, no byte fallback
    with pytest.raises(InvalidRequest, match="cannot write"):
        make_matcher(GuidedSpec("json_object"), tok, 2048)


@pytest.mark.parametrize("spec, match", [
    (GuidedSpec("json_schema", "{not json"), "json_schema is not valid JSON"),
    (GuidedSpec("json_schema", '{"type": "foo"}'), "invalid json_schema"),
    (GuidedSpec("json_schema", "[1, 2]"), "must be a JSON object"),
    (GuidedSpec("regex", "[a-"), "invalid regex.*unclosed character class"),
    (GuidedSpec("choice", "[]"), "non-empty list"),
    (GuidedSpec("choice", '["a", 3]'), "non-empty list"),
    (GuidedSpec("choice", '"a"'), "non-empty list"),
    (GuidedSpec("grammar", "start: undefined_rule"), "invalid grammar.*undefined_rule"),
])
def test_bad_specs_are_invalid_requests(gguf, spec, match):
    with pytest.raises(InvalidRequest, match=match):
        make_matcher(spec, gguf.tokenizer, 512)


def test_matchers_are_independent_and_refusal_leaves_only_eos(gguf):
    tok = gguf.tokenizer
    spec = GuidedSpec("choice", '["ab", "cd"]')
    a, b = make_matcher(spec, tok, 512), make_matcher(spec, tok, 512)
    assert a.accept(tok.hf.token_to_id("a")) and a.accept(tok.hf.token_to_id("b"))
    mask = torch.ones(512, dtype=torch.bool)
    a.fill_mask(mask)
    assert mask.nonzero().flatten().tolist() == [2] and a.is_terminated()  # complete: only EOS (id 2) may follow
    assert a.accept(2) and a.is_terminated()
    mask = torch.ones(512, dtype=torch.bool)
    b.fill_mask(mask)  # b is still at the start
    assert mask[tok.hf.token_to_id("a")] and mask[tok.hf.token_to_id("c")] and not mask[2]
    assert not b.accept(tok.hf.token_to_id("x"))
    assert b.error() is not None and not b.is_terminated()
    mask = torch.ones(512, dtype=torch.bool)
    b.fill_mask(mask)
    assert mask.nonzero().flatten().tolist() == [2]


def test_mask_only_narrows_and_works_on_strided_views(gguf):
    tok = gguf.tokenizer
    m = make_matcher(GuidedSpec("regex", "[a-z]+"), tok, 512)
    rows = torch.ones(512, 2, dtype=torch.bool)
    rows[tok.hf.token_to_id("a"), 0] = False  # the caller had already banned "a" (e.g. bad_words)
    view = rows[:, 0]  # not contiguous: the torch path
    m.fill_mask(view)
    assert not rows[tok.hf.token_to_id("a"), 0] and rows[tok.hf.token_to_id("b"), 0]
    assert not rows[tok.hf.token_to_id("<0x7B>"), 0] and rows[:, 1].all()


def test_tokenizer_index_and_compiled_grammar_are_reused(gguf):
    tok = gguf.tokenizer
    assert tokenizer_index(tok, 512) is tokenizer_index(tok, 512, tok.eos_token_ids)
    assert tokenizer_index(tok, 512) is not tokenizer_index(tok, 520)
    from splitserve.engine import guided

    spec = GuidedSpec("regex", "[0-9]{3}-cache-test")
    make_matcher(spec, tok, 512)
    compiled = guided._compiled[(tokenizer_index(tok, 512), spec)]
    make_matcher(spec, tok, 512)
    assert guided._compiled[(tokenizer_index(tok, 512), spec)] is compiled
