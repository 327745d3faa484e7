"""One chat choice's text through the reasoning and tool-call parsers: streamed deltas (reasoning_content, content,
tool_calls with index, id, name, then argument fragments) and the final message, as vLLM returns them. A tool-calls
section the model leaves malformed comes back as plain content with the engine's finish_reason; a forced call the
model leaves unfinished keeps what was streamed of it, with the engine's finish_reason."""

from __future__ import annotations

from .forced_calls import ForcedCalls
from .reasoning import ReasoningParser
from .tool_parsers import ToolCall, ToolParser


class ChoiceOutput:
    """Feed each step's new text; `delta()` gives what is new since the last call, `message()` the whole answer."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        forced: str | None = None,
        kimi_first: int | None = None,
    ):
        self.reasoning, self.tools = reasoning, tools
        self.forced = ForcedCalls(forced, kimi_first) if forced is not None else None
        self.forced_valid = False  # the forced call's JSON came out whole: finish_reason tool_calls
        self.text = ""
        self.sent_reasoning = self.sent_content = 0
        self.sent_args: list[int] = []  # per streamed call: argument characters sent
        self.called = False

    def _parse(self, final: bool) -> tuple[str | None, str | None, list[ToolCall]]:
        """-> (reasoning, content: None while the model still reasons, calls)."""
        reasoning, content = self.reasoning.split(self.text, final) if self.reasoning else (None, self.text)
        if content is None:
            return reasoning, None, []
        if self.forced is not None:  # tool_choice named or required: the output is JSON (vLLM's forms)
            for m in self.reasoning.also_ends if self.reasoning else ():
                content = content.removeprefix(m)  # a marker that ended the reasoning, before the grammar held
            calls, self.forced_valid = self.forced.parse(content, final)
            return reasoning, ("" if calls or not final else content), calls
        if self.tools is None:
            return reasoning, content, []
        text, calls, malformed = self.tools.parse(content, final)
        if final and malformed:
            return reasoning, content, []  # the raw text (vLLM), markers and all
        return reasoning, text, calls

    def delta(self, new_text: str, final: bool) -> dict:
        """The delta message for this step (empty when the parsers hold everything back)."""
        self.text += new_text
        reasoning, content, calls = self._parse(final)
        out: dict = {}
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            out["reasoning_content"] = reasoning[self.sent_reasoning :]
            self.sent_reasoning = len(reasoning)
        content = content or ""
        if len(content) > self.sent_content:
            out["content"] = content[self.sent_content :]
            self.sent_content = len(content)
        deltas = []
        for i, c in enumerate(calls):
            if i == len(self.sent_args):
                if c.name is None:
                    break
                fn = {"name": c.name, "arguments": c.arguments}
                deltas.append({"index": i, "id": c.id, "type": "function", "function": fn})
                self.sent_args.append(len(c.arguments))
            elif len(c.arguments) > self.sent_args[i]:
                deltas.append({"index": i, "function": {"arguments": c.arguments[self.sent_args[i] :]}})
                self.sent_args[i] = len(c.arguments)
        if deltas:
            out["tool_calls"] = deltas
            self.called = True
        return out

    def message(self) -> dict:
        """The non-streamed assistant message of the whole text."""
        reasoning, content, calls = self._parse(final=True)
        # null content while the model never finished reasoning, or beside tool calls (vLLM)
        msg: dict = {"role": "assistant", "content": None if content is None or (calls and not content) else content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
            self.called = True
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        called = self.forced_valid if self.forced is not None else self.called
        return "tool_calls" if engine_reason is not None and called else engine_reason
