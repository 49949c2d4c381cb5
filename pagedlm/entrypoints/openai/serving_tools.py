"""What a chat request's `tools`, `tool_choice` and tool messages mean for this server: which
tools the chat template renders, which parser reads the output, and which JSON schema
constrains it. Bad input is a ToolRequestError naming the field (a 400)."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Callable

from pagedlm.entrypoints.openai.protocol import ChatMessage
from pagedlm.entrypoints.openai.protocol_chat import (ChatCompletionNamedToolChoiceParam,
                                                      ChatCompletionRequest,
                                                      ChatCompletionToolsParam)
from pagedlm.entrypoints.openai.tool_parsers import ToolParser
from pagedlm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedlm.entrypoints.openai.tool_parsers.constrained import (NamedFunctionParser,
                                                                 RequiredToolsParser,
                                                                 named_function_schema,
                                                                 required_tools_schema)

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools."""
    template_tools: list[dict] | None  # rendered by the chat template; None: no tools shown
    make_parser: Callable[[], ToolParser] | None  # None: the output is plain content
    schema: dict | None  # JSON schema the output must follow (required / named)
    # The field the schema came from: the engine's errors about it (a schema its grammar
    # compiler rejects) name this field, not structured_outputs, which the client never sent.
    schema_field: str = "tools"


NO_TOOLS = ToolPlan(None, None, None)


def check_tools(tools: list[ChatCompletionToolsParam] | None) -> None:
    """A request's tools as chat completions and /tokenize take them (ToolRequestError)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        fn = tool.function
        if not _FUNCTION_NAME.match(fn.name):
            raise ToolRequestError(
                f"tools[{i}].function.name: {fn.name!r} is not a valid function name (1 to 64 "
                f"letters, digits, '_' or '-').", f"tools.{i}.function.name")
        if fn.name in seen:
            raise ToolRequestError(f"tools[{i}].function.name: {fn.name!r} is given twice.",
                                   f"tools.{i}.function.name")
        seen.add(fn.name)
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ToolRequestError(
                f"tools[{i}].function.parameters must be a JSON schema of an object "
                f"(type 'object'); got type {params.get('type')!r}.",
                f"tools.{i}.function.parameters")
        if params is not None and not isinstance(params.get("properties", {}), dict):
            raise ToolRequestError(
                f"tools[{i}].function.parameters.properties must be a mapping of property "
                f"names to schemas; got {type(params['properties']).__name__}.",
                f"tools.{i}.function.parameters.properties")


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's rules for tool turns: a tool message answers a call of the assistant turn
    before it, by id; an assistant's call arguments are a JSON object."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or []):
            if m.role != "assistant":
                raise ToolRequestError(f"messages[{i}].tool_calls: only assistant messages "
                                       f"have tool_calls, not {m.role!r}.",
                                       f"messages.{i}.tool_calls")
            err: object = None
            try:
                args = json.loads(call.function.arguments)
            except ValueError as e:
                args, err = None, e
            except RecursionError:
                args, err = None, "it is nested too deeply"
            if not isinstance(args, dict):
                raise ToolRequestError(
                    f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object "
                    f"as text" + (f" ({err})." if err is not None else "."),
                    f"messages.{i}.tool_calls.{j}.function.arguments")
        if m.role == "tool":
            if not m.tool_call_id:
                raise ToolRequestError(f"messages[{i}].tool_call_id: a tool message needs the "
                                       f"id of the call it answers.",
                                       f"messages.{i}.tool_call_id")
            if m.tool_call_id not in open_calls:
                raise ToolRequestError(
                    f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no tool call of "
                    f"the assistant message before it.", f"messages.{i}.tool_call_id")
        else:
            open_calls = {c.id for c in m.tool_calls or []}


def plan_tools(request: ChatCompletionRequest, auto_parser: type[ToolParser] | None) -> ToolPlan:
    """The request's ToolPlan; auto_parser is the server's --tool-call-parser when
    --enable-auto-tool-choice is on, else None."""
    check_tool_messages(request.messages)
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise ToolRequestError("tool_choice needs tools: no tools were given.",
                                   "tool_choice")
        return NO_TOOLS
    check_tools(request.tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        # The model is not told of tools it may not call.
        return NO_TOOLS
    tools = [t.model_dump(exclude_none=True) for t in request.tools]
    if choice == "auto":
        if auto_parser is None:
            raise ToolRequestError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser.', "tool_choice")
        return ToolPlan(tools, auto_parser, None)
    if choice == "required":
        schema = required_tools_schema([(t.function.name, t.function.parameters)
                                        for t in request.tools])
        return ToolPlan(tools, RequiredToolsParser, schema)
    assert isinstance(choice, ChatCompletionNamedToolChoiceParam)
    name = choice.function.name
    fn = next((t.function for t in request.tools if t.function.name == name), None)
    if fn is None:
        raise ToolRequestError(f"tool_choice: the function {name!r} is not among the given "
                               f"tools ({', '.join(t.function.name for t in request.tools)}).",
                               "tool_choice")
    index = next(i for i, t in enumerate(request.tools) if t.function.name == name)
    return ToolPlan(tools, lambda: NamedFunctionParser(name),
                    named_function_schema(fn.parameters), f"tools.{index}.function.parameters")


def constrain_to_json_schema(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """`params` whose output must follow the plan's schema (tool_choice required / named)."""
    if params.structured_outputs is not None:
        raise ToolRequestError("tool_choice 'required' or a named function constrains the "
                               "output itself: it cannot be combined with response_format or "
                               "structured outputs.", "tool_choice")
    if params.use_beam_search:
        raise ToolRequestError("tool_choice 'required' or a named function constrains the "
                               "output: it is not supported with use_beam_search.",
                               "tool_choice")
    # Without free whitespace: measured on SmolLM2-135M, greedy "required" output with any
    # whitespace allowed wrote the call array in indented form and kept repeating its calls
    # until max_tokens (120); without it, one call and "]" in 27 tokens.
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
        json=plan.schema, disable_any_whitespace=True, source_field=plan.schema_field))
