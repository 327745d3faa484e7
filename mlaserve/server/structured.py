"""A request's structured-output fields -> one StructuredOutput (types.py), as OpenAI and vLLM spell them:

    response_format      {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}
    guided_json          a JSON schema (an object, or its JSON text)
    guided_regex         a regular expression
    guided_choice        a list of strings
    guided_grammar       an EBNF (GBNF) or Lark grammar
    structured_outputs   {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM's newer form)

At most one may ask for structure. Shapes are checked here (a ValueError naming the field); whether the schema,
regex or grammar compiles is the engine's check (engine/grammar.py), also a 400 naming the field.
"""

from __future__ import annotations

import json

from ..types import StructuredOutput

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")
UNSUPPORTED_SO = ("structural_tag",)  # vLLM's tool-call tags: not implemented, refused


def _schema_text(field: str, v) -> str:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"{field}: the JSON schema is not valid JSON ({e})") from None
    if not isinstance(v, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object, got {type(v).__name__}")
    return json.dumps(v)


def _one(field: str, kind: str, v) -> StructuredOutput:
    """One field's value of one kind -> StructuredOutput (ValueError naming the field)."""
    if kind == "json":
        return StructuredOutput("json", _schema_text(field, v), field=field)
    if kind == "choice":
        if not isinstance(v, list) or not v or any(not isinstance(c, str) or not c for c in v):
            raise ValueError(f"{field}: the choices must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", choices=tuple(v), field=field)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{field}: a {kind} must be a non-empty string, got {v!r}")
    return StructuredOutput(kind, v, field=field)


def _response_format(v) -> StructuredOutput | None:
    field = "response_format"
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise ValueError(f"{field}: must be an object with a type (text, json_object or json_schema), got {v!r}")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", field=field)
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError(f"{field}: json_schema must be an object with the schema, got {js!r}")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:  # no schema: any JSON object, as OpenAI allows
            return StructuredOutput("json_object", field=field)
        return StructuredOutput("json", _schema_text(f"{field}", schema), field=field)
    raise ValueError(f"{field}: type must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(v) -> StructuredOutput | None:
    field = "structured_outputs"
    if not isinstance(v, dict):
        raise ValueError(f"{field}: must be an object with one of {', '.join(SO_KEYS)}, got {v!r}")
    for k in UNSUPPORTED_SO:
        if v.get(k) is not None:
            raise ValueError(f"{field}: {k} is not supported (use json, regex, choice or grammar)")
    given = [k for k in SO_KEYS if v.get(k) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"{field}: give one of {', '.join(SO_KEYS)}, got {', '.join(given)}")
    if not given:
        return None
    k = given[0]
    if k == "json_object":
        return StructuredOutput("json_object", field=field)
    return _one(field, k, v[k])


def structured_output(req) -> StructuredOutput | None:
    """The request's structured output, or None; ValueError 'field: why' for a bad shape or two kinds at once."""
    found: list[StructuredOutput] = []
    if req.response_format is not None:
        so = _response_format(req.response_format)
        found += [so] if so else []
    for name in GUIDED:
        v = getattr(req, name)
        if v is not None:
            found.append(_one(name, name.removeprefix("guided_"), v))
    if req.structured_outputs is not None:
        so = _structured_outputs(req.structured_outputs)
        found += [so] if so else []
    if len(found) > 1:
        raise ValueError(f"{found[1].field}: one structured output per request; {found[0].field} asks for one too")
    return found[0] if found else None
