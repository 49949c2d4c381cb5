"""Tool-call parsers for `--tool-call-parser`, by name, and the grammar-constrained readers for
tool_choice "required" and a named function."""
from __future__ import annotations

from pagedlm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ExtractedToolCalls,
                                                                          ParsedOutput,
                                                                          ParsedToolCall,
                                                                          ToolParser)
from pagedlm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from pagedlm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from pagedlm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown tool-call parser {name!r}; the parsers are "
                         f"{', '.join(sorted(TOOL_PARSERS))}.") from None


__all__ = ["ExtractedToolCalls", "ParsedOutput", "ParsedToolCall", "ToolParser",
           "TOOL_PARSERS", "get_tool_parser", "HermesToolParser", "Llama3JsonToolParser",
           "PythonicToolParser"]
