"""Scanning JSON that may be cut short: where a value ends, and a call object's name and
arguments text, without waiting for the closing brace."""
from __future__ import annotations

import json
import re

from pagedlm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                          is_json)

_WS = " \t\r\n"
_SCALAR_END = set(_WS) | set(",]}:")

# {"name": "...", "arguments": (or "parameters":) — the layout every format here asks for
# (and the one a JSON-schema grammar writes, properties in schema order).
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                        r'"(?:arguments|parameters)"\s*:\s*')


def skip_ws(s: str, pos: int) -> int:
    while pos < len(s) and s[pos] in _WS:
        pos += 1
    return pos


def value_end(s: str, pos: int, final: bool = False) -> int | None:
    """End (exclusive) of the JSON value starting at s[pos], or None if the text stops before
    it ends. Only the structure is checked (brackets and strings); json.loads decides validity.
    A bare scalar at the end of unfinished text is not over: more digits may follow."""
    if pos >= len(s):
        return None
    if s[pos] not in "{[\"":
        end = pos
        while end < len(s) and s[end] not in _SCALAR_END:
            end += 1
        return end if end < len(s) or final else None
    depth, in_str, escaped = 0, False, False
    for i in range(pos, len(s)):
        ch = s[i]
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def utf8(text: str) -> bool:
    """False for text holding a lone surrogate: JSON's \\ud83d (half of an escaped pair, as
    a model may write) decodes to one, which no response can carry (the serializer raised:
    a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_text(value) -> str:
    """value as JSON, its non-ASCII characters as themselves where UTF-8 can carry them."""
    text = json.dumps(value, ensure_ascii=False)
    return text if utf8(text) else json.dumps(value)


def scan_call(obj: str, complete: bool) -> ParsedToolCall | None:
    """The call in `obj`, a {"name", "arguments"|"parameters"} object written so far.

    With name first (the usual order), the name is known as soon as it is whole and the
    arguments text grows with the output. Otherwise nothing is known until the object is
    complete. None: a complete object that is not a valid call.
    """
    head = _CALL_HEAD.match(obj)
    if head is not None:
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:  # an escape JSON does not have, such as \q
            return None
        if not utf8(name):
            return None
        start = head.end()
        end = value_end(obj, start, final=complete)
        if end is None:
            return None if complete else ParsedToolCall(name, obj[start:])
        args = obj[start:end]
        if not complete:
            return ParsedToolCall(name, args)
        if not is_json(obj) or not is_json(args):
            return None
        return ParsedToolCall(name, args, done=True)
    if not complete:
        return ParsedToolCall(None)
    try:
        data = json.loads(obj)
        if (not isinstance(data, dict) or not isinstance(data.get("name"), str)
                or not utf8(data["name"])):
            return None
        args = json_text(data.get("arguments", data.get("parameters", {})))
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to read
        return None
    return ParsedToolCall(data["name"], args, done=True)


def scan_call_sequence(s: str, pos: int, final: bool, separators: str,
                       closer: str | None = None):
    """Calls written as JSON objects one after another from s[pos], between `separators`
    characters (and whitespace), until `closer` (an array's "]") or the end.
    Returns (calls, invalid)."""
    calls: list[ParsedToolCall] = []
    while True:
        pos = skip_ws(s, pos)
        if pos >= len(s):
            return calls, final and (closer is not None or not calls)
        if s[pos] != "{":
            # the array's end, or text after the calls: ignored (vLLM does the same)
            bad = closer is not None and s[pos] != closer
            return calls, final and bad
        end = value_end(s, pos)
        call = scan_call(s[pos:end] if end is not None else s[pos:], end is not None)
        if call is None:
            return calls, True
        calls.append(call)
        if end is None:
            return calls, final
        pos = skip_ws(s, end)
        while pos < len(s) and s[pos] in separators:
            pos = skip_ws(s, pos + 1)
