"""Tool-call parsers by the names vLLM gives them (`--tool-call-parser`)."""

from __future__ import annotations

from .base import ToolCall, ToolParser
from .deepseek_v3 import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from .kimi_k2 import KimiK2ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "kimi_k2": KimiK2ToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
}

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser"]
