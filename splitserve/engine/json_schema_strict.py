"""Closing a JSON Schema's objects: ``additionalProperties: false`` wherever the schema leaves it open.

JSON Schema lets an object carry properties it does not list unless ``additionalProperties`` says otherwise. A
grammar built from such a schema lets a small model keep inventing keys and never close the object (seen with
stories260K: ``{"name":"Tom","age":3," said Tom. ":...`` until max_tokens). OpenAI's strict structured outputs
require ``additionalProperties: false`` on every object, and vLLM's default grammar backend (xgrammar,
``strict_mode=True``) treats unlisted properties as forbidden; this does the same for our backend (llguidance).
An object that sets ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties`` keeps its own rule.
"""

from __future__ import annotations

import copy
from typing import Any

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema, ...]
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
               "unevaluatedItems")  # one subschema
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that lists ``properties`` (or says ``type: object``)
    and sets none of ``additionalProperties`` / ``patternProperties`` / ``unevaluatedProperties`` gets
    ``additionalProperties: false``. Walks subschemas by keyword (a property *named* "properties" is not
    mistaken for the keyword). Non-dict input is returned as is."""
    schema = copy.deepcopy(schema)
    _close(schema)
    return schema


def _close(node: Any) -> None:
    if not isinstance(node, dict):
        return
    is_object = "properties" in node or node.get("type") == "object"
    if is_object and not any(k in node for k in _OPEN_KEYS):
        node["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for child in sub.values():
                _close(child)
    for key in _SCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for child in sub:
                _close(child)
    for key in _SCHEMA_ONE:
        _close(node.get(key))
    if isinstance(node.get("additionalProperties"), dict):
        _close(node["additionalProperties"])
