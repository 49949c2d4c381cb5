"""The xgrammar backend: JSON schema, regex, choice, EBNF and any-JSON grammars on the CPU."""
from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch
import xgrammar as xgr

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.backend import (CompiledGrammar, GrammarMatcher,
                                               StructuredOutputBackend)


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals for xgrammar (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# json_object means a JSON object (OpenAI's), not any JSON value as xgrammar's builtin grammar;
# not strict, or only {} would match.
_ANY_OBJECT = {"type": "object"}
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.M)


def _compile(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams
             ) -> xgr.CompiledGrammar:
    kind, any_ws = params.kind, not params.disable_any_whitespace
    if kind == "json":
        return compiler.compile_json_schema(params.json, any_whitespace=any_ws)
    if kind == "json_object":
        return compiler.compile_json_schema(_ANY_OBJECT, strict_mode=False, any_whitespace=any_ws)
    if kind == "regex":
        return compiler.compile_grammar(xgr.Grammar.from_regex(params.regex))
    if kind == "choice":
        return compiler.compile_grammar(xgr.Grammar.from_ebnf(_choice_ebnf(params.choice)))
    return compiler.compile_grammar(xgr.Grammar.from_ebnf(params.grammar))


class XGrammarMatcher(GrammarMatcher):

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class XGrammarCompiled(CompiledGrammar):

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled))


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        # vocab_size is the model's (its logits' width before padding), which may exceed the
        # tokenizer's: xgrammar never allows the ids that have no token.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids))
        threads = max(1, min(8, os.cpu_count() or 1))
        # Compiles run at low priority beside the engine (manager.py): half the cores at most.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max(1, threads // 2))
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        if params.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the "
                             "xgrammar backend (use disable_any_whitespace).")

    def compile(self, params: StructuredOutputsParams) -> XGrammarCompiled:
        return XGrammarCompiled(_compile(self.compiler, params))

    def sandbox_state(self) -> bytes:
        return self.tokenizer_info.serialize_json().encode()

    @classmethod
    def sandbox_compiler(cls, state: bytes) -> Callable[[StructuredOutputsParams], None]:
        info = xgr.TokenizerInfo.deserialize_json(state.decode())
        # One thread, and no cache: each spec is compiled here once (the manager caches).
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

        def compile_spec(params: StructuredOutputsParams) -> None:
            cls.validate(params)
            try:
                _compile(compiler, params)
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - xgrammar reports bad specs as RuntimeError
                # Without the C++ log prefix: "[12:00:00] /project/cpp/regex_converter.cc:83: ".
                reason = _LOG_PREFIX.sub("", str(e)).strip()
                raise ValueError(f"{params.field_name} is invalid: {reason}") from None

        return compile_spec

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                     rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask,
                                                 indices=rows)
