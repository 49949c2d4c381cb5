"""tool_choice "required" and a named function: the output is constrained by a JSON-schema
grammar (vLLM's approach), so these "parsers" read JSON the grammar guarantees.

- named: the output is the arguments object for that function's `parameters`;
- required: a non-empty array of {"name", "parameters"} objects, anyOf over the tools.
"""
from __future__ import annotations

from pagedlm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedOutput,
                                                                          ParsedToolCall,
                                                                          ToolParser, is_json)
from pagedlm.entrypoints.openai.tool_parsers.json_scan import scan_call_sequence, skip_ws

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def named_function_schema(parameters: dict | None) -> dict:
    return parameters if parameters is not None else EMPTY_PARAMETERS


def required_tools_schema(functions: list[tuple[str, dict | None]]) -> dict:
    """An array of one or more calls, each {"name": one tool's name, "parameters": that tool's
    parameters}. Name comes first, so a streamed call's name is known before its arguments."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [name]},
                        "parameters": named_function_schema(parameters)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, parameters in functions]}}


class NamedFunctionParser(ToolParser):
    """The whole output is the named function's arguments."""
    name = "named_function"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput(calls=[ParsedToolCall(self.function_name, text, done=final)],
                            invalid=final and not is_json(text))


class RequiredToolsParser(ToolParser):
    """The output is a JSON array of {"name", "parameters"} calls."""
    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        if pos >= len(text):
            return ParsedOutput(invalid=final)
        if text[pos] != "[":
            return ParsedOutput(invalid=final)
        calls, invalid = scan_call_sequence(text, pos + 1, final, separators=",", closer="]")
        return ParsedOutput(calls=calls, invalid=invalid)
