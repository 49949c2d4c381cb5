"""Streams a parser's calls the way OpenAI does: per call, one delta with its index, id, type
and name, then fragments of its arguments; plain content before the calls as content deltas."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.entrypoints.openai.protocol import random_uuid
from pagedlm.entrypoints.openai.protocol_chat import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from pagedlm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser


def tool_call_id() -> str:
    return f"call_{random_uuid()[:24]}"


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


@dataclass
class ToolCallStreamer:
    """One choice's stream: feed() each text delta, get the message delta to send (or None)."""
    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    calls: list[_SentCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    def feed(self, delta_text: str, final: bool) -> DeltaMessage | None:
        self.text += delta_text
        parsed = self.parser.parse(self.text, final)
        content = None
        # Content stops at the first call; a final parse that gives up on a broken call still
        # only extends what was sent.
        if not self.calls and len(parsed.content) > self.content_sent \
                and parsed.content.startswith(self.text[:self.content_sent]):
            content = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # its name is still being written; later calls come after it
            if index == len(self.calls):
                self.calls.append(_SentCall(tool_call_id()))
                sent = self.calls[index]
                sent.arguments_sent = len(call.arguments)
                deltas.append(DeltaToolCall(index=index, id=sent.id, type="function",
                                            function=DeltaFunctionCall(
                                                name=call.name, arguments=call.arguments)))
                continue
            sent = self.calls[index]
            if len(call.arguments) > sent.arguments_sent:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                    arguments=call.arguments[sent.arguments_sent:])))
                sent.arguments_sent = len(call.arguments)
        if content is None and not deltas:
            return None
        return DeltaMessage(content=content, tool_calls=deltas or None)
