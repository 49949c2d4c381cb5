"""Llama 3.1 / 3.2 JSON format: the whole reply is {"name": ..., "parameters": {...}}, several
separated by ";", optionally after <|python_tag|> (if special tokens are kept). A reply that does
not start with "{" is plain content."""
from __future__ import annotations

from pagedlm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolParser
from pagedlm.entrypoints.openai.tool_parsers.json_scan import scan_call_sequence, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return ParsedOutput()  # empty, or the tag's start: not decided yet
        if pos >= len(text):
            return ParsedOutput(content=text if final else "")
        if text[pos] != "{":
            return ParsedOutput(content=text)
        calls, invalid = scan_call_sequence(text, pos, final, separators=";")
        return ParsedOutput(calls=calls, invalid=invalid)
