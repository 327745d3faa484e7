"""The chat request's tools, tool_choice and reasoning as vLLM handles them: tools checked (names, JSON Schema
parameters), tool_choice "none" / "auto" / "required" / a named function, the server's parsers (`--tool-call-parser`,
`--reasoning-parser`, `--enable-auto-tool-choice`), and the marker tokens the detokenizer must keep for them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ..config import generation_sampling_defaults
from ..types import StructuredOutput
from .chat_output import ChoiceOutput
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ChatOptions:
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    generation_config: str = "auto"  # auto: the model's generation_config.json sets sampling defaults; vllm: ignored

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser: must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser: must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"--generation-config: must be auto or vllm, got {self.generation_config!r}")


def sampling_defaults(model_dir: str, options: ChatOptions) -> dict:
    """generation_config.json's sampling fields, which requests that leave them unset take (--generation-config
    auto); none with vllm or without the file."""
    if options.generation_config != "auto":
        return {}
    return generation_sampling_defaults(model_dir)


def check_tools(tools) -> list[dict] | None:
    """The request's `tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}
    whose parameters are a valid JSON Schema. Raises ValueError naming the field."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list of tool objects, got {type(tools).__name__}")
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ValueError(f"{where}: must be an object of type 'function'")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: must be an object with a name")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.function.name: must be a non-empty string")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description: must be a string")
        params = fn.get("parameters")
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters: must be a JSON Schema object, got {type(params).__name__}")
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as e:
            path = "".join(f"[{p!r}]" for p in e.path)
            raise ValueError(f"{where}.function.parameters{path}: not a valid JSON Schema: {e.message}") from None
    return tools


def check_tool_choice(choice, tools: list[dict] | None):
    """ "none" | "auto" | "required" | {"type": "function", "function": {"name"}} naming one of the tools; unset:
    "auto" with tools, else "none" (vLLM's defaults)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice: {choice!r} needs `tools`")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(
            f'tool_choice: must be "none", "auto", "required" or {{"type": "function", ...}}, got {choice!r}'
        )
    names = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in names:
        raise ValueError(f"tool_choice: function {fn['name']!r} is not among the tools ({', '.join(names) or 'none'})")
    return choice


@dataclass
class ChatPlan:
    """What one chat request runs with: the template's tools, the parsers of each choice, the ids to keep."""

    template_tools: list[dict] | None
    keep_ids: frozenset[int]
    make_output: Callable[[], ChoiceOutput | None]
    structured: StructuredOutput | None = None  # tool_choice required or named: the JSON the output must follow

    def output(self) -> ChoiceOutput | None:
        """A fresh parser state for one choice; None when the text passes through as content."""
        return self.make_output()


def plan_chat(req, options: ChatOptions, tok) -> ChatPlan:
    """Raises ValueError (a 400) for a tool_choice the server is not set up for, as vLLM does."""
    choice = req.tool_choice
    tools = req.tools
    use_parser = bool(tools) and choice != "none"
    if choice == "auto" and tools and not (options.enable_auto_tool_choice and options.tool_call_parser):
        raise ValueError(
            'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser'
        )
    forced = None
    if use_parser and choice != "auto":
        forced = "required" if choice == "required" else choice["function"]["name"]
    # forced calls are JSON under a grammar (vLLM), not the model's own call format: no tool parser then
    tool_cls = TOOL_PARSERS.get(options.tool_call_parser) if use_parser and forced is None else None
    reasoning_cls = REASONING_PARSERS.get(options.reasoning_parser)
    kwargs = req.chat_template_kwargs or {}
    markers = [*(tool_cls().markers if tool_cls else ()), *(reasoning_cls(kwargs).markers if reasoning_cls else ())]
    ids = {m: tok.backend.token_to_id(m) if tok is not None else None for m in markers}
    keep = frozenset(i for i in ids.values() if i is not None)
    # a forced call on a thinking model: it reasons freely, and the grammar holds from the token that ends the
    # reasoning (vLLM's structured output under a reasoning parser); without such a token, from the first token
    reasoning = reasoning_cls(kwargs) if reasoning_cls else None
    after: tuple[int, ...] = ()
    if forced is not None and reasoning is not None and reasoning.thinking:
        after = tuple(i for m in (reasoning.end, *reasoning.also_ends) if (i := ids.get(m)) is not None)
        if not after:
            reasoning_cls = None  # no token to wait for: all the output is the call's JSON

    # Kimi's forced calls take its ids (functions.NAME:INDEX, counted over the conversation), as vLLM gives them
    kimi_first = None
    if forced is not None and options.tool_call_parser == "kimi_k2":
        kimi_first = sum(
            len(tc) for m in req.messages if isinstance(tc := (m.model_extra or {}).get("tool_calls"), list)
        )

    def make():
        if tool_cls is None and reasoning_cls is None and forced is None:
            return None
        return ChoiceOutput(
            reasoning_cls(kwargs) if reasoning_cls else None,
            tool_cls() if tool_cls else None,
            forced=forced,
            kimi_first=kimi_first,
        )

    structured = None
    if forced is not None:
        spec = json.dumps(forced_schema(tools, forced))
        structured = StructuredOutput("json", spec, field="tool_choice", after_token_ids=after)
    return ChatPlan(tools, keep, make, structured)


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def forced_schema(tools: list[dict], forced: str) -> dict:
    """vLLM's schema for a forced call: a named function's parameters; "required": a non-empty array of
    {"name", "parameters"} objects, anyOf over the tools, their $defs lifted to the root (their $refs point there)."""
    fns = [t["function"] for t in tools]
    if forced != "required":
        return _parameters(next(f for f in fns if f["name"] == forced))
    defs: dict = {}
    variants = []
    for f in fns:
        params = dict(_parameters(f))
        defs.update(params.pop("$defs", None) or {})
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema
