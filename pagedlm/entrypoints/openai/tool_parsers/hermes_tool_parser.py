"""Hermes / Qwen format: content, then calls as <tool_call>{"name": ..., "arguments": {...}}
</tool_call>, one tag pair per call."""
from __future__ import annotations

from pagedlm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedOutput,
                                                                          ToolParser, held_back)
from pagedlm.entrypoints.openai.tool_parsers.json_scan import scan_call, skip_ws, value_end

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(OPEN)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, OPEN)
            return ParsedOutput(content=text[:keep])
        out = ParsedOutput(content=text[:first])
        pos = first
        while pos >= 0:
            start = pos + len(OPEN)
            close = text.find(CLOSE, start)
            body = text[start:close] if close >= 0 else text[start:]
            if close < 0 and not final:
                body = body[:len(body) - held_back(body, CLOSE)]
            obj_start = skip_ws(body, 0)
            complete = close >= 0 or final
            end = value_end(body, obj_start, final=complete) if obj_start < len(body) else None
            if end is None and complete:
                out.invalid = True  # an empty or unterminated call
                return out
            call = scan_call(body[obj_start:end] if end is not None else body[obj_start:],
                             complete=end is not None)
            if call is None:
                out.invalid = True
                return out
            out.calls.append(call)
            if close < 0:
                break
            pos = text.find(OPEN, close + len(CLOSE))
        return out
