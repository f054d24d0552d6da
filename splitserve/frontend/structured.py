"""Structured-output request fields -> one :class:`GuidedSpec` (or None), with a 400 naming the field otherwise.

Fields (OpenAI and vLLM's extras; at most one of them may constrain a request):

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``.
- ``guided_json``: a JSON Schema, as an object or as a string holding one.
- ``guided_regex``: a regular expression the whole output must match.
- ``guided_choice``: a list of strings; the output is exactly one of them.
- ``guided_grammar``: a Lark grammar or a llama.cpp GBNF grammar (see :mod:`splitserve.engine.guided`).

:func:`check_guided` compiles the spec once against the served tokenizer so a bad schema, regex or grammar
is refused at the front door (the compiled grammar is cached for the worker in the same process).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from splitserve.engine.guided_spec import GuidedSpec
from splitserve.errors import InvalidRequest
from splitserve.frontend.errors import APIError

GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""Request fields that carry a structured-output constraint (all optional, default None)."""

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def guided_spec(req: Any) -> tuple[GuidedSpec, str] | None:
    """The request's structured-output constraint and the field it came from, or None.

    ``req`` is any request model; fields it lacks count as absent.

    Raises:
        APIError: 400 naming the field for a malformed value, or when two fields constrain the output.
    """
    given = [(f, getattr(req, f, None)) for f in GUIDED_FIELDS]
    specs = [(f, s) for f, v in given if v is not None and (s := _spec_of(f, v)) is not None]
    if len(specs) > 1:
        names = " and ".join(f"'{f}'" for f, _ in specs)
        raise APIError(f"Only one structured-output constraint may be given per request; got {names}.", param=specs[1][0])
    return (specs[0][1], specs[0][0]) if specs else None


def _spec_of(field: str, v: Any) -> GuidedSpec | None:
    if field == "response_format":
        return response_format_spec(v)
    if field == "guided_json":
        return GuidedSpec("json_schema", _schema_text(v, field))
    if field in ("guided_regex", "guided_grammar"):
        if not isinstance(v, str) or not v:
            raise APIError(f"'{field}' must be a non-empty string.", param=field)
        return GuidedSpec("regex" if field == "guided_regex" else "grammar", v)
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise APIError("'guided_choice' must be a non-empty list of non-empty strings.", param=field)
    return GuidedSpec("choice", json.dumps(v, ensure_ascii=False))


def response_format_spec(v: Any) -> GuidedSpec | None:
    """The spec of an OpenAI ``response_format`` value (None for ``{"type": "text"}``). Raises APIError (400)."""
    if not isinstance(v, dict):
        raise APIError("'response_format' must be an object such as {\"type\": \"json_object\"}.", param="response_format")
    kind = v.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise APIError(f"Invalid value for 'response_format.type': {kind!r}; supported: 'text', 'json_object', 'json_schema'.",
                       param="response_format.type")
    extra = sorted(set(v) - allowed[kind])
    if extra:
        raise APIError(f"Unrecognized argument in 'response_format': {extra[0]}", param=f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object")
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise APIError("'response_format.json_schema' must be an object with 'name' and 'schema'.", param="response_format.json_schema")
    extra = sorted(set(js) - _JSON_SCHEMA_KEYS)
    if extra:
        raise APIError(f"Unrecognized argument in 'response_format.json_schema': {extra[0]}",
                       param=f"response_format.json_schema.{extra[0]}")
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'.",
                       param="response_format.json_schema.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise APIError("'response_format.json_schema.strict' must be a boolean.", param="response_format.json_schema.strict")
    if "schema" not in js:
        return GuidedSpec("json_object")  # OpenAI: without a schema the model may answer any JSON object
    return GuidedSpec("json_schema", _schema_text(js["schema"], "response_format.json_schema.schema"))


def _schema_text(v: Any, param: str) -> str:
    """A JSON Schema given as an object or a string, as canonical JSON text. Raises APIError (400)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise APIError(f"'{param}' is not valid JSON: {e}", param=param) from None
    if not isinstance(v, dict):
        raise APIError(f"'{param}' must be a JSON Schema object.", param=param)
    return json.dumps(v, ensure_ascii=False, sort_keys=False)


def check_guided(spec: GuidedSpec, param: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None) -> None:
    """Compile ``spec`` for the served model (cached) so a bad one is a 400 here, not a worker error.

    Raises:
        APIError: 400 naming ``param`` with the grammar library's reason.
    """
    from splitserve.engine.guided import make_matcher  # llguidance: only when a request asks for it

    try:
        make_matcher(spec, tokenizer, vocab_size, eos_token_ids)
    except InvalidRequest as e:
        raise APIError(f"Invalid '{param}': {e}", param=param) from None


def with_guided(prepared: Any, req: Any, tokenizer: Any, tool_spec: GuidedSpec | None = None) -> Any:
    """``prepared`` (a :class:`.prepare.PreparedRequest`) with ``params.guided`` set from the request's fields
    or from ``tool_spec`` (:meth:`.tools.ToolPlan.guided`); unchanged when neither constrains the output.

    The spec is compiled once here against the served ``tokenizer`` (its own vocabulary and EOS ids; the
    workers build their matchers with the model's vocab_size) so that a bad one is a 400 at the front door.

    Raises:
        APIError: 400 for a malformed or conflicting constraint, or with ``ignore_eos`` (a grammar ends
            the output with EOS).
    """
    found = guided_spec(req)
    if found is not None and tool_spec is not None:
        raise APIError(f"'{found[1]}' cannot be combined with tool_choice 'required' or a named function.", param=found[1])
    spec, param = found if found is not None else (tool_spec, "tools")
    if spec is None:
        return prepared
    if prepared.params.ignore_eos:
        raise APIError("'ignore_eos' cannot be combined with structured outputs or forced tool calls.", param="ignore_eos")
    check_guided(spec, param, tokenizer, tokenizer.hf.get_vocab_size(with_added_tokens=True), tokenizer.eos_token_ids)
    return replace(prepared, params=replace(prepared.params, guided=spec))
