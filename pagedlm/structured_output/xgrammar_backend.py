"""The xgrammar backend: JSON schema, regex, choice, EBNF and any-JSON grammars on the CPU."""
from __future__ import annotations

import json
import os

import torch
import xgrammar as xgr

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.backend import (CompiledGrammar, GrammarMatcher,
                                               StructuredOutputBackend)


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals for xgrammar (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    kind = params.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(params.json,
                                            any_whitespace=not params.disable_any_whitespace)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


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
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids))
        threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        if params.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the "
                             "xgrammar backend (use disable_any_whitespace).")
        try:
            _grammar(params)
        except Exception as e:  # noqa: BLE001 - xgrammar reports parse errors as RuntimeError
            raise ValueError(f"{params.field_name} is invalid: {e}") from None

    def compile(self, params: StructuredOutputsParams) -> XGrammarCompiled:
        if params.kind == "json":
            compiled = self.compiler.compile_json_schema(
                params.json, any_whitespace=not params.disable_any_whitespace)
        elif params.kind == "json_object":
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_grammar(_grammar(params))
        return XGrammarCompiled(compiled)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                     rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask,
                                                 indices=rows)
