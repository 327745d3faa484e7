"""Forced tool calls (tool_choice a named function or "required") read from the grammar's JSON as it is generated,
so their arguments stream in fragments, as vLLM streams them: a named function's output is its arguments object;
"required" is a JSON array of {"name", "parameters"}. Arguments are the model's own JSON text (a parameters value's
span), so every streamed prefix is a prefix of the final arguments and the stream adds up to the message."""

from __future__ import annotations

import json

from .tool_parsers.base import ToolCall, new_tool_call_id

WS = " \t\n\r"


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at text[i]; None while the text ends inside it (a scalar at the
    very end may still grow)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in WS + ",]}":
        j += 1
    return j if j < len(text) else None


def _array_calls(text: str) -> list[tuple[str | None, str, bool]]:
    """'[{"name": ..., "parameters": {...}}, ...' so far -> (name or None, arguments so far, complete) per element
    begun; stops at the first thing that is not that shape (the final json.loads judges the whole)."""
    out: list[tuple[str | None, str, bool]] = []
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "[":
        return out
    i = _skip(text, i + 1)
    while i < len(text) and text[i] == "{":
        name, args, i = None, "", _skip(text, i + 1)
        done = False
        while i < len(text) and text[i] == '"':
            k_end = value_end(text, i)
            if k_end is None:
                break
            key = json.loads(text[i:k_end])
            i = _skip(text, k_end)
            if i >= len(text) or text[i] != ":":
                break
            v = _skip(text, i + 1)
            v_end = value_end(text, v)
            if key == "parameters":
                args = text[v : len(text) if v_end is None else v_end].rstrip()
            if v_end is None:
                break
            if key == "name":
                value = json.loads(text[v:v_end])
                name = value if isinstance(value, str) else None
            i = _skip(text, v_end)
            if i < len(text) and text[i] == ",":
                i = _skip(text, i + 1)
            elif i < len(text) and text[i] == "}":
                done, i = True, _skip(text, i + 1)
                break
        out.append((name, args, done))
        if not done or i >= len(text) or text[i] != ",":
            break
        i = _skip(text, i + 1)
    return out


class ForcedCalls:
    """One choice's forced calls. parse(text, final) -> (calls so far, valid): valid once final and the whole text is
    the JSON the grammar asks for. Ids are fixed once given (streamed deltas and the final answer agree); with
    `kimi_first` they are Kimi's `functions.NAME:INDEX`, counted on from the conversation's earlier calls (vLLM's
    kimi_k2 ids: Kimi's template writes the id back as the call's header)."""

    def __init__(self, forced: str, kimi_first: int | None = None):
        self.forced, self.kimi_first = forced, kimi_first
        self._ids: list[str] = []

    def _id(self, index: int, name: str) -> str:
        while len(self._ids) <= index:
            k = len(self._ids)
            self._ids.append(
                new_tool_call_id() if self.kimi_first is None else f"functions.{name}:{self.kimi_first + k}"
            )
        return self._ids[index]

    def parse(self, text: str, final: bool) -> tuple[list[ToolCall], bool]:
        valid = False
        if final:
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if self.forced != "required":
                valid = isinstance(value, dict)
            else:
                valid = (
                    isinstance(value, list)
                    and bool(value)
                    and all(
                        isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("parameters"), dict)
                        for v in value
                    )
                )
        if self.forced != "required":
            args = text.strip()
            ok = args.startswith("{")  # an object begun: the grammar's arguments, not stray text
            return ([ToolCall(self._id(0, self.forced), self.forced, args, valid)] if ok else []), valid
        calls = []
        for i, (name, args, done) in enumerate(_array_calls(text)):
            if name is None:
                break
            calls.append(ToolCall(self._id(i, name), name, args, done and valid))
        return calls, valid
