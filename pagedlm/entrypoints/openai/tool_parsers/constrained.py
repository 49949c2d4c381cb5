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
    parameters}. Name comes first, so a streamed call's name is known before its arguments.
    A tool's local references ("#/$defs/Address", as openai.pydantic_function_tool writes
    nested models, or "#" itself) are relative to its own parameters, which sit deeper here:
    they are rewritten to point there."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [name]},
                        "parameters": _rebase_refs(named_function_schema(parameters),
                                                   f"#/items/anyOf/{i}/properties/parameters")},
         "required": ["name", "parameters"], "additionalProperties": False}
        for i, (name, parameters) in enumerate(functions)]}}


# Keywords whose values are JSON data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names (which may be any word, "enum" too) to schemas.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                            "dependentSchemas"})


def _rebase_refs(schema, root: str):
    """`schema` with every local "$ref" ("#" or "#/...") moved under the JSON pointer `root`."""
    if isinstance(schema, list):
        return [_rebase_refs(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, root)
    return out


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
