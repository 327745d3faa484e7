"""DeepSeek tool calls. V3 / R1 (vLLM's `deepseek_v3`):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "X"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (vLLM's `deepseek_v31`): <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "X"}<｜tool▁call▁end｜>.
"""

from __future__ import annotations

from .base import ToolCall, ToolParser

FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"

    @property
    def markers(self) -> tuple[str, ...]:
        return (*super().markers, self.sep)

    def parse_call(self, index: int, body: str, complete: bool) -> ToolCall | None:
        kind, sep, rest = body.partition(self.sep)
        if not sep:
            return None if complete else ToolCall("", None, "", False)
        if kind.strip() != "function":
            return None
        name, nl, block = rest.partition("\n")
        if not nl or not name.strip():
            return None if complete else ToolCall("", None, "", False)
        block = block.strip() if complete else block
        if not block.startswith(FENCE_OPEN):
            if complete or not FENCE_OPEN.startswith(block):
                return None
            block = FENCE_OPEN  # the fence is still arriving
        args = block[len(FENCE_OPEN) :]
        if complete:
            if not args.endswith(FENCE_CLOSE.strip()):
                return None
            args = args[: -len(FENCE_CLOSE.strip())]
        cid = self.call_id(index, name)
        return ToolCall(cid, name.strip(), self.streamed_args(args, complete, self.call_end, FENCE_CLOSE), complete)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"

    def parse_call(self, index: int, body: str, complete: bool) -> ToolCall | None:
        name, sep, args = body.partition(self.sep)
        if not sep:
            return None if complete else ToolCall("", None, "", False)
        if not name.strip():
            return None
        args = self.streamed_args(args, complete, self.call_end)
        return ToolCall(self.call_id(index, name), name.strip(), args, complete)
