"""Twenty JSON schemas for the structured-output tests (tests/test_structured_outputs_e2e.py).

They cover nested objects, arrays (with ``minItems``/``maxItems``), enums (strings, numbers, mixed), integers and
numbers with bounds, booleans, required and optional fields, ``const``, ``anyOf`` and ``$defs``/``$ref``. Free
strings carry a ``maxLength`` and arrays a ``maxItems`` so that a 656K-parameter story model, constrained by the
grammar, closes every value well within the test's token budget; every object is closed (``additionalProperties:
false``: an open object lets the model wander into extra keys). The one free-form ``number`` (weather_report) is
bounded; a story model may otherwise keep writing fraction digits. Each is valid Draft 2020-12.
"""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
COLOR = {"type": "string", "enum": ["red", "green", "blue"]}


def _obj(properties: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


SCHEMAS: dict[str, dict] = {
    "flat_person": _obj({"name": NAME, "age": {"type": "integer", "minimum": 1, "maximum": 99}}),
    "boolean_flag": _obj({"happy": {"type": "boolean"}}),
    "string_enum": _obj({"mood": {"type": "string", "enum": ["happy", "sad", "angry", "sleepy"]}}),
    "integer_enum": _obj({"stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}}),
    "number_enum": _obj({"score": {"type": "number", "enum": [0.5, 2.25, 7.5]}}),
    "nested_object": _obj({"pet": _obj({"kind": {"type": "string", "enum": ["cat", "dog", "bird"]}, "name": NAME})}),
    "array_of_enums": _obj({"colors": {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3}}),
    "array_of_integers": _obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "minItems": 2, "maxItems": 4}}),
    "array_of_objects": _obj({"friends": {"type": "array", "minItems": 1, "maxItems": 2,
                                          "items": _obj({"name": NAME, "age": {"type": "integer", "minimum": 1, "maximum": 12}})}}),
    "optional_fields": _obj({"title": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 50},
                             "color": COLOR}, required=["title"]),
    "story_character": _obj({"name": NAME, "animal": {"type": "string", "enum": ["cat", "dog", "bear", "fish"]},
                             "brave": {"type": "boolean"}, "age": {"type": "integer", "minimum": 1, "maximum": 20}}),
    "deeply_nested": _obj({"house": _obj({"room": _obj({"toy": _obj({"color": COLOR, "count": {"type": "integer", "minimum": 0,
                                                                                                  "maximum": 5}})})})}),
    "const_and_enum": _obj({"type": {"const": "story"}, "ending": {"type": "string", "enum": ["happy", "sad"]}}),
    "mixed_enum": _obj({"value": {"enum": ["one", 2, True, None]}}),
    "nullable_field": _obj({"name": NAME, "nickname": {"anyOf": [NAME, {"type": "null"}]}}),
    "array_of_strings": _obj({"words": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8},
                                        "minItems": 1, "maxItems": 3}}),
    "defs_and_ref": {"$defs": {"toy": _obj({"name": NAME, "color": COLOR})},
                     **_obj({"first": {"$ref": "#/$defs/toy"}, "second": {"$ref": "#/$defs/toy"}})},
    "weather_report": _obj({"city": NAME, "temperature": {"type": "number", "minimum": -20, "maximum": 40},
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "rain": {"type": "boolean"}}),
    "shopping_list": _obj({"store": NAME, "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
        "item": {"type": "string", "enum": ["apple", "milk", "bread", "cake"]}, "count": {"type": "integer", "minimum": 1, "maximum": 6}})}}),
    "event": _obj({"what": {"type": "string", "enum": ["party", "picnic", "game"]},
                   "day": {"type": "string", "enum": ["monday", "friday", "sunday"]},
                   "guests": {"type": "integer", "minimum": 0, "maximum": 10}, "outside": {"type": "boolean"},
                   "host": _obj({"name": NAME, "helper": NAME}, required=["name"])}),
}


def strict_compatible(schema) -> bool:
    """Whether ``schema`` follows OpenAI's strict-mode rules for objects: every object closed
    (``additionalProperties: false``) with every property required. Only such schemas are sent with ``strict: true``."""
    if isinstance(schema, list):
        return all(strict_compatible(s) for s in schema)
    if not isinstance(schema, dict):
        return True
    if schema.get("type") == "object":
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is not False or set(schema.get("required", [])) != set(props):
            return False
    return all(strict_compatible(v) for k, v in schema.items() if k not in ("enum", "const"))
