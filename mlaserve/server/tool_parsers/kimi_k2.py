"""Kimi-K2 / K2.5 tool calls (vLLM's `kimi_k2`):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "X"}
    <|tool_call_end|>...<|tool_calls_section_end|>

The call's id is its header (`functions.get_weather:0`), as Kimi's template expects it back.
"""

from __future__ import annotations

import re

from .base import ToolCall, ToolParser

HEADER = re.compile(r"[^<]+:\d+")


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    call_end = "<|tool_call_end|>"
    arg_begin = "<|tool_call_argument_begin|>"

    @property
    def markers(self) -> tuple[str, ...]:
        return (*super().markers, self.arg_begin)

    def parse(self, text: str, final: bool):
        # K2 also writes the section markers in the singular
        text = text.replace("<|tool_call_section_begin|>", self.section_begin)
        return super().parse(text.replace("<|tool_call_section_end|>", self.section_end), final)

    def parse_call(self, index: int, body: str, complete: bool) -> ToolCall | None:
        header, sep, args = body.partition(self.arg_begin)
        header = header.strip()
        if not sep:
            if complete:
                return None
            return ToolCall("", None, "", False) if "<" not in header else None
        if not HEADER.fullmatch(header):
            return None
        name = header.split(":")[0].split(".")[-1]
        return ToolCall(header, name, self.streamed_args(args, complete, self.call_end), complete)
