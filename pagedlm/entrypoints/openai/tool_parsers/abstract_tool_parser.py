"""The tool-parser interface: a parser turns a model's raw text into plain content plus tool
calls, and can do so on a growing prefix of the text, which is how calls are streamed.

One method, `parse(text, final)`, serves both paths. On a prefix (final=False) it returns only
what can no longer change: content that cannot turn out to be the start of a tool-call tag, a
call's name once it is whole, and the part of its arguments text already written. Every later
parse extends those strings, so the streamer sends the differences and the fragments it sends
concatenate to the arguments the non-streamed path returns for the same text.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class ParsedToolCall:
    name: str | None      # None until the whole name has been generated
    arguments: str = ""   # the arguments' JSON text, or the part of it written so far
    done: bool = False    # the call is complete: arguments is the whole JSON value


@dataclass
class ParsedOutput:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)
    # final parse only: a call region was found but is not valid (bad JSON, cut short)
    invalid: bool = False


@dataclass
class ExtractedToolCalls:
    """A whole output's parse: tool calls (name, arguments JSON) and the content around them."""
    content: str | None
    calls: list[tuple[str, str]]

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


class ToolParser(ABC):
    """Parses one output format. Instances are cheap and stateless; one per request choice."""

    name: str = ""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of `text`; final=False means more text may follow."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The non-streamed result. Output whose tool-call part does not parse is returned
        whole as content (as vLLM does): a client then sees what the model wrote."""
        parsed = self.parse(text, final=True)
        if parsed.invalid or not parsed.calls or any(
                c.name is None or not c.done for c in parsed.calls):
            return ExtractedToolCalls(content=text, calls=[])
        return ExtractedToolCalls(content=parsed.content or None,
                                  calls=[(c.name, c.arguments) for c in parsed.calls])


def is_json(text: str) -> bool:
    """Whether `text` is JSON this server can read: nesting too deep for the parser is not
    (the model writes text; a RecursionError must not make the response a 500)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag` (held back from
    streamed content until the next text decides)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
