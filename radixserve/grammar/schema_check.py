"""A JSON Schema checked before xgrammar sees it: refused by keyword, with where it is, when the
backend would not enforce it, and refused with the limit when it is too large to compile in
bounded time.

xgrammar 0.2.9 silently drops a keyword it does not implement (`uniqueItems`, `contains`, `not`,
`if`, a second `allOf` branch, `multipleOf` on a number, a `format` it does not know ...), lets
`oneOf` fall back to `anyOf`, ignores every keyword beside `$ref`, `const`, `enum`, `anyOf`, `oneOf`
and `allOf`, ignores `minLength`/`maxLength` beside a `pattern` or `format` and `pattern` beside
`format`, and enforces some formats loosely (radixserve.grammar.string_formats). Each of these was measured to let
violating output end with `finish_reason: stop`; each is a 400 here instead.

Compile cost: optional properties grow the compile about cubically (1,000 optional properties of
one object take 1.7 s against Qwen2's vocabulary, 300 take 0.1 s), nesting grows building the
grammar steeply (depth 200 took 2 s before any vocabulary work, depth 50 0.06 s), and a 10,000-value
enum takes 0.8 s and 27 MB. The limits below keep the worst schema well under a second or two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.grammar.regex_check import RegexRefused, check_regex, optional_groups_counted
from radixserve.grammar.string_formats import REPLACED, format_problem

MAX_SCHEMA_BYTES = 128 * 1024
MAX_DEPTH = 32
MAX_PROPERTIES_PER_OBJECT = 1024
# Optional properties are what grows the compile about cubically (measured on the tiny model's
# vocabulary: 8 objects of 250 optional bounded strings 5.9 s, 4 objects of 128 0.14 s).
MAX_OPTIONAL_PROPERTIES_PER_OBJECT = 128
MAX_TOTAL_PROPERTIES = 2048
MAX_ENUM_VALUES = 1024
MAX_SUBSCHEMAS = 4096
MAX_PATTERN_LENGTH = 1000
# xgrammar enforces an integer multipleOf up to this and ignores larger ones.
MAX_INTEGER_MULTIPLE_OF = 1024

# Keywords xgrammar does not implement; each one constrains the value, so none may be dropped.
NOT_ENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef", "additionalItems")
# Keywords that constrain a value (every one of them xgrammar reads somewhere). Anything else is an
# annotation (title, description, default, examples, $defs, $schema, discriminator, x-...).
VALIDATION = frozenset(("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "properties", "required",
                        "additionalProperties", "unevaluatedProperties", "patternProperties", "propertyNames",
                        "minProperties", "maxProperties", "items", "prefixItems", "unevaluatedItems", "minItems",
                        "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format", "minimum",
                        "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", *NOT_ENFORCED))
# xgrammar reads only the keyword itself where one of these is present (first match wins).
EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
                  "not", "if", "then", "else", "contains", "additionalItems")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "array": (list,), "object": (dict,)}


class SchemaRefused(ValueError):
    """A schema the backend would not enforce, or one over a limit; the message names the keyword,
    where it is, and the limit."""


@dataclass
class _Walk:
    root: Any
    subschemas: int = 0
    properties: int = 0
    seen_refs: set[str] = field(default_factory=set)


def check_schema(schema: Any) -> None:
    """SchemaRefused when `schema` (parsed JSON) uses what the backend does not enforce, or exceeds
    a limit."""
    try:
        _check(schema, "#", 0, _Walk(schema))
    except (TypeError, AttributeError) as e:  # a keyword of the wrong shape (xgrammar would refuse it too)
        raise SchemaRefused(f"the schema is malformed: {e}") from None


def enforceable_schema(schema: Any) -> Any:
    """A schema `check_schema` passed, as the backend is to get it: each `format` whose backend
    grammar lets invalid values through replaced by the pattern of its valid values
    (radixserve.grammar.string_formats), and each pattern's optional groups written so the backend
    enforces them (radixserve.grammar.regex_check.optional_groups_counted). `schema` itself when
    nothing changes."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if schema.get("format") in REPLACED:
        del out["format"]
        out["pattern"] = f"^({REPLACED[schema['format']]})$"
    if isinstance(out.get("pattern"), str):
        out["pattern"] = optional_groups_counted(out["pattern"])
    if isinstance(schema.get("patternProperties"), dict):
        out["patternProperties"] = {optional_groups_counted(k): v for k, v in schema["patternProperties"].items()}
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: enforceable_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [enforceable_schema(sub) for sub in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = enforceable_schema(out[key])
    return schema if out == schema else out


def _check(schema: Any, where: str, depth: int, walk: _Walk) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaRefused(f"the schema at {where} is not an object or a boolean")
    walk.subschemas += 1
    if walk.subschemas > MAX_SUBSCHEMAS:
        raise SchemaRefused(f"the schema has more than {MAX_SUBSCHEMAS} subschemas (the limit)")
    if depth > MAX_DEPTH:
        raise SchemaRefused(f"the schema nests deeper than {MAX_DEPTH} levels (the limit) at {where[:200]}")
    for keyword in NOT_ENFORCED:
        if keyword in schema:
            _refuse(keyword, where)
    if schema.get("uniqueItems") is True:
        _refuse("uniqueItems", where)
    _check_exclusive(schema, where)
    _check_values(schema, where, walk)
    _check_strings(schema, where)
    _check_numbers(schema, where)
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                _check(sub, f"{where}/{key}/{_escape(name)}", depth + 1, walk)
    for key in _SUBSCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                _check(sub, f"{where}/{key}/{i}", depth + 1, walk)
    for key in _SUBSCHEMA_ONE:
        if key in schema and isinstance(schema[key], (dict, bool)):
            _check(schema[key], f"{where}/{key}", depth + 1, walk)


def _refuse(keyword: str, where: str, why: str = "the grammar backend does not enforce it") -> None:
    raise SchemaRefused(f"JSON Schema keyword {keyword!r} at {where[:200]} is not supported: {why}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _check_exclusive(schema: dict, where: str) -> None:
    present = [k for k in EXCLUSIVE if k in schema]
    if not present:
        return
    first = present[0]
    if first == "$ref":
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            _refuse("$ref", where, f"{str(ref)[:100]!r} is not a reference into this schema (#/...); "
                                   "external references are not fetched")
    if first == "allOf" and isinstance(schema["allOf"], list) and len(schema["allOf"]) > 1:
        _refuse("allOf", where, "only an allOf of one schema is enforced; merge the schemas into one")
    if first == "oneOf" and isinstance(schema["oneOf"], list) and not _disjoint(schema["oneOf"]):
        _refuse("oneOf", where, "its branches are not provably disjoint (the backend would accept a value "
                                "that matches several); use anyOf, or give each branch a required property "
                                "with a distinct const")
    for keyword in schema:
        if keyword == first or keyword not in VALIDATION:
            continue
        if first in ("const", "enum") and keyword == "type":
            continue  # checked against the values below
        _refuse(keyword, where, f"it is ignored beside {first!r}; move it into the {first} schema")


def _disjoint(branches: list) -> bool:
    """Whether no value can match two branches: each branch has a different single `type`, or all
    are objects that require one property whose `const` differs between them."""
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"integer", "number"} <= set(types):
        return True
    tags = []
    for b in branches:
        if not isinstance(b, dict):
            return False
        props = b.get("properties") or {}
        required = set(_names(b.get("required")))
        tags.append({name: json_key(p["const"]) for name, p in props.items()
                     if name in required and isinstance(p, dict) and "const" in p})
    common = set.intersection(*(set(t) for t in tags)) if tags else set()
    return any(len({t[name] for t in tags}) == len(tags) for name in common)


def json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _check_values(schema: dict, where: str, walk: _Walk) -> None:
    enum = schema.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_ENUM_VALUES:
        raise SchemaRefused(f"enum at {where[:200]} has {len(enum)} values; the limit is {MAX_ENUM_VALUES}")
    kind = schema.get("type")
    if kind is not None and ("const" in schema or "enum" in schema):
        kinds = kind if isinstance(kind, list) else [kind]
        values = [schema["const"]] if "const" in schema else (enum if isinstance(enum, list) else [])
        for value in values:
            if not any(_is_type(value, k) for k in kinds):
                _refuse("type", where, f"the value {json_key(value)[:60]} is not of type {kind}, and the "
                                       "backend would let it through")
    props = schema.get("properties")
    if isinstance(props, dict):
        if len(props) > MAX_PROPERTIES_PER_OBJECT:
            raise SchemaRefused(f"the object at {where[:200]} has {len(props)} properties; the limit is "
                                f"{MAX_PROPERTIES_PER_OBJECT}")
        optional = len(props) - len(set(_names(schema.get("required"))) & set(props))
        if optional > MAX_OPTIONAL_PROPERTIES_PER_OBJECT:
            raise SchemaRefused(f"the object at {where[:200]} has {optional} optional properties (not in "
                                f"required); the limit is {MAX_OPTIONAL_PROPERTIES_PER_OBJECT}")
        walk.properties += len(props)
        if walk.properties > MAX_TOTAL_PROPERTIES:
            raise SchemaRefused(f"the schema has more than {MAX_TOTAL_PROPERTIES} properties in all (the limit)")
    required = schema.get("required")
    # Strict mode: no additionalProperties means none, so a required name outside `properties`
    # can never appear, and the backend leaves it out rather than refusing the schema.
    if isinstance(required, list) and schema.get("additionalProperties", False) is False \
            and "patternProperties" not in schema and "unevaluatedProperties" not in schema:
        missing = [r for r in required if not isinstance(props, dict) or r not in props]
        if missing:
            _refuse("required", where, f"{missing[0]!r} is not among the properties, and the backend would "
                                       "leave it out")


def _names(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _is_type(value: Any, kind: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, float)
                                                                         and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES.get(kind, ()))


def _check_strings(schema: dict, where: str) -> None:
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    for holder in ("pattern", "format"):
        if holder in schema and lengths:
            _refuse(lengths[0], where, f"it is ignored beside {holder!r}; put the length into the pattern "
                                       "or leave one out")
    problem = format_problem(schema)
    if problem is not None:
        _refuse(problem[0], where, problem[1])
    patterns = []
    if isinstance(schema.get("pattern"), str):
        patterns.append((schema["pattern"], f"{where}/pattern"))
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [(p, f"{where}/patternProperties") for p in schema["patternProperties"]]
    for pattern, at in patterns:
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise SchemaRefused(f"the pattern at {at[:200]} has {len(pattern)} characters; the limit is "
                                f"{MAX_PATTERN_LENGTH}")
        try:
            check_regex(pattern, in_json_string=True, what=f"the pattern at {at[:200]}")
        except RegexRefused as e:
            raise SchemaRefused(str(e)) from None


def _check_numbers(schema: dict, where: str) -> None:
    if "multipleOf" not in schema:
        return
    kind = schema.get("type")
    step = schema["multipleOf"]
    if kind != "integer":
        _refuse("multipleOf", where, "it is enforced for type integer only")
    if not isinstance(step, (int, float)) or isinstance(step, bool) or step != int(step) \
            or not 0 < step <= MAX_INTEGER_MULTIPLE_OF:
        _refuse("multipleOf", where, f"it is enforced for whole numbers from 1 to {MAX_INTEGER_MULTIPLE_OF} only")
