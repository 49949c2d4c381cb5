"""Bounds on a structured-output spec, checked where the spec is built, before anything parses
or compiles it.

They keep the cheap checks cheap: a JSON schema is parsed (and its nesting measured) on the
caller's thread, and xgrammar's own parse grows faster than linearly with nesting. They do not
bound compile time, which size predicts badly (one thread, benchmarks/request_interference.py:
64 levels of nested objects 0.02 s; 1024 choices of 1024 characters 32 s; a 128 KiB object of
2872 optional string properties over a minute). The compile time limit does that
(structured_outputs_compile_timeout, enforced in a child process that is killed when it runs
over: sandbox.py). Each bound is far above what real schemas, regexes and grammars need; an
error names the bound it failed.
"""
from __future__ import annotations

import json
from typing import Any

# A JSON schema's text (or its dict serialized), in UTF-8 bytes: OpenAI's tool and response
# schemas are a few KiB; "required" tool choice joins every tool's parameters into one.
MAX_JSON_SCHEMA_BYTES = 128 * 1024
# Nesting of the schema document (each object or array is one level; a schema-level property
# takes two: {"properties": {"name": {...}}}). xgrammar's parse and compile time grow faster
# than linearly with it (nested objects, on a busy 2-core machine: 64 levels 0.2 s, 128 levels
# 1.1 s), and json.loads gives up past about 1000.
MAX_JSON_SCHEMA_DEPTH = 64
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024  # each choice


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _depth_over(obj: Any, limit: int) -> int:
    """The nesting depth of a parsed JSON value, or the first depth past `limit` found (the
    walk stops there). Iterative: a deep value must not exhaust the Python stack."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json_schema(name: str, schema: str | dict | bool) -> Any:
    """The schema parsed (a str) or as given, once its size and nesting are within bounds;
    ValueError naming `name` and the bound otherwise."""
    if isinstance(schema, str):
        size = _utf8_len(schema)
        if size > MAX_JSON_SCHEMA_BYTES:
            raise ValueError(f"{name} is {size} bytes long, past the limit of "
                             f"{MAX_JSON_SCHEMA_BYTES} (JSON schema size).")
        try:
            parsed = json.loads(schema)
        except RecursionError:  # nested past the interpreter's recursion limit
            raise ValueError(f"{name} nests more than {MAX_JSON_SCHEMA_DEPTH} levels deep, "
                             f"past the limit (JSON schema nesting depth).") from None
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}.") from None
    else:
        parsed = schema
    depth = _depth_over(parsed, MAX_JSON_SCHEMA_DEPTH)
    if depth > MAX_JSON_SCHEMA_DEPTH:
        raise ValueError(f"{name} nests more than {MAX_JSON_SCHEMA_DEPTH} levels deep, past "
                         f"the limit (JSON schema nesting depth).")
    if not isinstance(schema, str):
        try:
            size = _utf8_len(json.dumps(schema))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name} is not a JSON value: {e}.") from None
        if size > MAX_JSON_SCHEMA_BYTES:
            raise ValueError(f"{name} is {size} bytes as JSON, past the limit of "
                             f"{MAX_JSON_SCHEMA_BYTES} (JSON schema size).")
    return parsed


# `spec` is a StructuredOutputsParams, not imported: sampling_params imports this module and must
# stay a leaf of the import graph.
def check_spec_size(spec: Any, name: str) -> None:
    """The regex, grammar and choice bounds (the JSON schema's are parse_json_schema's), on a
    spec whose fields already have the right types."""
    if spec.regex is not None and len(spec.regex) > MAX_REGEX_CHARS:
        raise ValueError(f"{name} is {len(spec.regex)} characters long, past the limit of "
                         f"{MAX_REGEX_CHARS} (regex length).")
    if spec.grammar is not None and len(spec.grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} is {len(spec.grammar)} characters long, past the limit of "
                         f"{MAX_GRAMMAR_CHARS} (grammar length).")
    if spec.choice is not None:
        if len(spec.choice) > MAX_CHOICES:
            raise ValueError(f"{name} has {len(spec.choice)} choices, past the limit of "
                             f"{MAX_CHOICES} (number of choices).")
        longest = max(range(len(spec.choice)), key=lambda i: len(spec.choice[i]))
        if len(spec.choice[longest]) > MAX_CHOICE_CHARS:
            raise ValueError(f"{name}: choice {longest} is {len(spec.choice[longest])} "
                             f"characters long, past the limit of {MAX_CHOICE_CHARS} (choice "
                             f"length).")
