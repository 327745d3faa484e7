"""What a tool-call parser gives back, and the parse shared by the marker formats: the text before the tool-calls
section is content, then one call per call-begin marker. Parsers read the whole text so far at every step, so the
streamed deltas are differences of two parses."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    id: str
    name: str | None  # None until the model has written it all
    arguments: str  # the JSON text so far (all of it once `complete`)
    complete: bool


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker (it may yet become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """A model family's tool-call markers. parse(text, final) -> (content, calls, malformed)."""

    name = ""
    section_begin = ""
    section_end = ""
    call_begin = ""
    call_end = ""

    def __init__(self):
        self._ids: list[str] = []

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker texts the parser reads: their tokens must survive skip_special_tokens."""
        return tuple(m for m in (self.section_begin, self.section_end, self.call_begin, self.call_end) if m)

    def call_id(self, index: int, header: str) -> str:
        """A call's id, fixed once given (streamed and final answers agree)."""
        while len(self._ids) <= index:
            self._ids.append(new_tool_call_id())
        return self._ids[index]

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCall], bool]:
        """content: the text before the section (a tail that may start a marker held back until final); calls: each
        call seen so far; malformed: the section was opened but does not hold well-formed, closed calls."""
        at = text.find(self.section_begin)
        if at < 0:
            hold = 0 if final else held_prefix(text, self.section_begin)
            return text[: len(text) - hold], [], False
        body = text[at + len(self.section_begin) :]
        end = body.find(self.section_end) if self.section_end else -1
        if end >= 0:
            body = body[:end]
        pieces = body.split(self.call_begin)
        calls, malformed = [], pieces[0].strip() != "" or len(pieces) == 1
        for i, piece in enumerate(pieces[1:]):
            complete = self.call_end in piece
            call = self.parse_call(i, piece.split(self.call_end)[0], complete)
            if call is None:
                malformed = True
                break
            calls.append(call)
            if not complete:
                malformed = True  # closed later, or never (then the answer is the raw text)
                break
        return text[:at], calls, malformed

    def parse_call(self, index: int, body: str, complete: bool) -> ToolCall | None:
        """One call's text between its markers (all of it when complete); None when it cannot be a call."""
        raise NotImplementedError

    @staticmethod
    def streamed_args(args: str, complete: bool, *tails: str) -> str:
        """Arguments as far as they are certain: stripped when complete; else without trailing whitespace or a tail
        that may start a closing marker (tails: the last in the text first), so every streamed prefix is a prefix of
        the final text."""
        args = args.lstrip()
        if complete:
            return args.rstrip()
        for t in tails:
            args = args.removesuffix(t)
            args = args[: len(args) - held_prefix(args, t)]
        return args.rstrip()
