"""close_objects: additionalProperties false wherever a schema leaves an object open, by keyword."""

from __future__ import annotations

import pytest

from splitserve.engine.json_schema_strict import close_objects

pytestmark = pytest.mark.unit


def test_objects_are_closed_at_every_depth_and_the_input_is_not_changed():
    schema = {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
        "properties": {"type": "object", "properties": {}},  # a property *named* "properties"
    }, "$defs": {"D": {"properties": {"x": {"type": "number"}}}}}
    out = close_objects(schema)
    assert "additionalProperties" not in schema  # a copy
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["person"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in props["either"]["anyOf"][1]
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["person"]["properties"]  # a name -> schema map is not a schema
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in props["tags"]  # an array is not an object


@pytest.mark.parametrize("own", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                 {"patternProperties": {"^x": {}}}, {"unevaluatedProperties": False}])
def test_an_object_that_sets_its_own_rule_keeps_it(own):
    out = close_objects({"type": "object", "properties": {"a": {}}, **own})
    for key, value in own.items():
        assert out[key] == value
    if "additionalProperties" not in own:
        assert "additionalProperties" not in out
