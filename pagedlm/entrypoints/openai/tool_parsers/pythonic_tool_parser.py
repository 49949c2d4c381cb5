"""Pythonic format (Llama 3.2 / 4 style): the reply is a Python list of calls with keyword
arguments, [get_weather(city="Paris", days=2), get_time()], optionally between
<|python_start|> and <|python_end|>. Argument values are Python literals, sent as JSON.

Streaming sends a call's name as soon as `name(` is written and its arguments once the call's
closing parenthesis is: a partial Python literal has no JSON text to send yet.
"""
from __future__ import annotations

import ast
import re

from pagedlm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedOutput,
                                                                          ParsedToolCall,
                                                                          ToolParser)
from pagedlm.entrypoints.openai.tool_parsers.json_scan import json_text, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
_CALL_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\(")


def _call_end(s: str, pos: int) -> int | None:
    """End (exclusive) of the parenthesised argument list opening at s[pos] ("("), or None."""
    depth, quote, escaped = 0, "", False
    for i in range(pos, len(s)):
        ch = s[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _arguments_json(call_text: str) -> str | None:
    """The JSON object of a call's keyword arguments, or None if it is not a literal call."""
    try:
        node = ast.parse(call_text.strip(), mode="eval").body
    except (SyntaxError, MemoryError, RecursionError):  # nesting past the parser's stack
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, RecursionError, MemoryError):
            return None
    try:
        return json_text(args)
    except (TypeError, ValueError, RecursionError):  # a set, bytes, complex: no JSON for it
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        if text.startswith(START, pos):
            pos = skip_ws(text, pos + len(START))
        elif not final and START.startswith(text[pos:]) and text[pos:]:
            return ParsedOutput()
        if pos >= len(text):
            return ParsedOutput(content=text if final else "")
        if text[pos] != "[":
            return ParsedOutput(content=text)
        out = ParsedOutput()
        pos += 1
        while True:
            head = _CALL_NAME.match(text, pos)
            if head is None:
                rest = text[skip_ws(text, pos):]
                closed = rest.startswith("]")
                if final and (not closed or not out.calls):
                    out.invalid = True
                return out
            name = head.group(1)
            end = _call_end(text, head.end() - 1)
            if end is None:
                out.calls.append(ParsedToolCall(name))
                out.invalid = final
                return out
            args = _arguments_json(text[head.start():end])
            if args is None:
                out.invalid = True
                return out
            out.calls.append(ParsedToolCall(name, args, done=True))
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ",":
                pos += 1
