"""Reasoning parsers by vLLM's names (`--reasoning-parser`): the text between <think> and </think> becomes
`reasoning_content`, the rest `content`. Like the tool parsers they read the whole text so far at every step."""

from __future__ import annotations

from .tool_parsers.base import held_prefix


class ReasoningParser:
    """deepseek_r1: the template opens <think>, so the output is reasoning until </think> (a leading <think> the
    model writes itself is dropped)."""

    name = "deepseek_r1"
    start, end = "<think>", "</think>"
    also_ends: tuple[str, ...] = ()  # markers that end the reasoning and stay in the content

    def __init__(self, chat_template_kwargs: dict | None = None):
        self.thinking = self.thinks(chat_template_kwargs or {})

    @staticmethod
    def thinks(kwargs: dict) -> bool:
        return True

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end, *self.also_ends)

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """-> (reasoning so far, content so far): content None while the model still reasons."""
        if not self.thinking:
            return None, text
        if text.startswith(self.start):
            text = text[len(self.start) :]
        elif not final and self.start.startswith(text):
            return "", None  # a <think> may be arriving
        ends = [(i, m) for m in (self.end, *self.also_ends) if (i := text.find(m)) >= 0]
        if ends:
            i, m = min(ends)
            return text[:i], text[i + len(m) :] if m == self.end else text[i:]
        hold = 0 if final else max(held_prefix(text, m) for m in (self.end, *self.also_ends))
        return text[: len(text) - hold], None


class DeepSeekV3Reasoning(ReasoningParser):
    """deepseek_v3: V3.1's hybrid template thinks only when chat_template_kwargs says `thinking`."""

    name = "deepseek_v3"

    @staticmethod
    def thinks(kwargs: dict) -> bool:
        return bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))


class KimiK2Reasoning(ReasoningParser):
    """kimi_k2: reasoning also ends where a tool-calls section starts; `thinking: false` turns it off."""

    name = "kimi_k2"
    also_ends = ("<|tool_calls_section_begin|>",)

    @staticmethod
    def thinks(kwargs: dict) -> bool:
        return bool(kwargs.get("thinking", True))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ReasoningParser,
    "deepseek_v3": DeepSeekV3Reasoning,
    "kimi_k2": KimiK2Reasoning,
}
