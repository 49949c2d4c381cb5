"""How much a hostile request slows a plain one, and how long specs at the grammar bounds compile.

Issue 29's target: a request whose grammar is compiling, or one with a long bad_words list,
slows a concurrent plain request by at most 20%; a 30,000-word list is refused.

--part compile: specs at each structured-output bound (structured_output/limits.py) and a tiny
schema past which only the time limit helps, compiled in the sandbox (one thread, as the engine
checks every new spec); prints each one's CPU seconds.

--part interference (an AsyncLLMEngine, as the server drives it): the latency of a plain greedy
request (--plain-tokens tokens), median of --repeats,
  - alone, then while a grammar compiles (choices that compile for tens of seconds, under a
    long compile timeout, so that they compile throughout), then while distinct medium schemas
    compile one after another (both stages: the sandbox, then the engine's own compile);
  - beside a long request with --bad-words multi-token bad words, against beside the same
    request without them (the batch of two costs more than one either way);
and the time to refuse a 30,000-word bad_words list. Run it pinned to two cores, as the 2-core
machine it targets:

    taskset -c 0,1 .venv/bin/python benchmarks/request_interference.py
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedlm import EngineArgs, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedlm.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from pagedlm.sampling_params import RequestOutputKind  # noqa: E402
from pagedlm.structured_output import limits  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
SLOW_SCHEMA = {"type": "array", "maxItems": 1000, "items": {
    "type": "array", "maxItems": 1000, "items": {"type": "string", "maxLength": 1000}}}
# As many choices as allowed, each as long as allowed: compiles for tens of seconds.
SLOW_CHOICES = ["".join(random.Random(i).choices(string.ascii_letters, k=limits.MAX_CHOICE_CHARS))
                for i in range(limits.MAX_CHOICES)]


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    while depth > 2:
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        depth -= 2
    return schema


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def any_of_chain(depth: int) -> dict:
    schema: dict = {"type": "string"}
    while depth > 3:  # {"anyOf": [ {...}, ... ]}: two levels, the alternatives' object a third
        schema = {"anyOf": [{"type": "integer"}, {"type": "array", "items": schema}]}
        depth -= 3
    return schema


def fill(make, limit: int) -> object:
    """The largest make(n) whose JSON stays within limit bytes."""
    lo, hi = 1, 1
    while len(json.dumps(make(hi))) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(json.dumps(make(mid))) <= limit else (lo, mid)
    return make(lo)


def bound_specs() -> list[tuple[str, StructuredOutputsParams]]:
    b = limits.MAX_JSON_SCHEMA_BYTES
    d = limits.MAX_JSON_SCHEMA_DEPTH
    wide = fill(lambda n: {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(n)}}, b)
    wide_optional_strings = fill(lambda n: {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 20} for i in range(n)}}, b)
    enum = fill(lambda n: {"enum": [f"value-{i}" for i in range(n)]}, b)
    rules = []
    i = 0
    while sum(map(len, rules)) < limits.MAX_GRAMMAR_CHARS - 200:
        rules.append(f'r{i} ::= "x{i}" r{i + 1} | [a-z]{{1,20}}\n')
        i += 1
    grammar = "root ::= r0\n" + "".join(rules) + f'r{i} ::= "end"\n'
    regex_unit = "([a-z]{1,50}[0-9]{1,50})"
    regex = regex_unit * (limits.MAX_REGEX_CHARS // len(regex_unit))
    specs = [
        (f"json: objects nested {d} levels", dict(json=nested_objects(d))),
        (f"json: arrays nested {d} levels", dict(json=nested_arrays(d))),
        (f"json: anyOf nested {d} levels", dict(json=any_of_chain(d))),
        (f"json: {len(wide['properties'])} integer properties ({b} B)", dict(json=wide)),
        (f"json: {len(wide_optional_strings['properties'])} optional strings ({b} B)",
         dict(json=wide_optional_strings)),
        (f"json: enum of {len(enum['enum'])} strings ({b} B)", dict(json=enum)),
        (f"regex: {len(regex)} chars of counted repeats", dict(regex=regex)),
        (f"grammar: {i + 2} rules, {len(grammar)} chars", dict(grammar=grammar)),
        (f"choice: {len(SLOW_CHOICES)} x {limits.MAX_CHOICE_CHARS} chars",
         dict(choice=SLOW_CHOICES)),
        (f"json: {len(json.dumps(SLOW_SCHEMA))} B of nested maxItems (past the bounds' reach)",
         dict(json=SLOW_SCHEMA)),
    ]
    return [(name, StructuredOutputsParams(**kw)) for name, kw in specs]


def compile_times(args) -> None:
    from transformers import AutoTokenizer

    from pagedlm.model_executor.model_loader.model_path import resolve_model
    from pagedlm.structured_output.sandbox import GrammarSandbox
    from pagedlm.structured_output.xgrammar_backend import XGrammarBackend
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    backend = XGrammarBackend(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))
    sandbox = GrammarSandbox("xgrammar", backend.sandbox_state, args.compile_limit)
    print(f"CPU seconds to compile, one thread (limit {args.compile_limit:g} s):")
    for name, spec in bound_specs():
        try:
            print(f"  {name}: {sandbox.check(spec):.2f} s", flush=True)
        except ValueError as e:
            print(f"  {name}: {e}", flush=True)
    sandbox.close()


async def generate(engine, rid: str, params: SamplingParams, prompt: str = PROMPT) -> None:
    async for _ in engine.generate(prompt, params, request_id=rid):
        pass


def greedy(tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY, **kw)


async def plain_latencies(engine, args, tag: str) -> list[float]:
    out = []
    for i in range(args.repeats):
        t = time.perf_counter()
        await generate(engine, f"{tag}-{i}", greedy(args.plain_tokens))
        out.append(time.perf_counter() - t)
    return out


def summary(name: str, lat: list[float], base: list[float] | None = None) -> None:
    med = statistics.median(lat)
    line = f"  {name}: median {med:.3f} s (min {min(lat):.3f}, max {max(lat):.3f})"
    if base is not None:
        line += f" = {med / statistics.median(base):.2f}x"
    print(line, flush=True)


async def interference(args) -> None:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=args.model, max_model_len=1024, structured_outputs_compile_timeout=args.compile_limit,
        max_bad_words=max(args.bad_words, 1000)), log_stats=False)
    try:
        # Warm-up: the model, and the sandbox (its start is paid once, not per grammar).
        await generate(engine, "warm", greedy(4, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no"])))
        await plain_latencies(engine, args, "warm-plain")
        print(f"plain request: {args.plain_tokens} greedy tokens, median of {args.repeats}")
        base = await plain_latencies(engine, args, "alone")
        summary("alone", base)

        slow = asyncio.ensure_future(generate(engine, "slow", greedy(
            4, structured_outputs=StructuredOutputsParams(choice=SLOW_CHOICES))))
        await asyncio.sleep(0.5)
        lat = await plain_latencies(engine, args, "beside-slow")
        still = not slow.done()
        summary("while a grammar compiles in the sandbox", lat, base)
        t = time.perf_counter()
        try:
            await slow
            outcome = "compiled"
        except ValueError as e:
            outcome = str(e)
        print(f"    (still compiling at the end: {still}; {time.perf_counter() - t:.1f} s "
              f"later: {outcome})", flush=True)

        stop = asyncio.Event()

        async def medium_grammars() -> int:
            n = 0
            while not stop.is_set():
                schema = {"type": "array", "maxItems": 40 + n, "items": {
                    "type": "array", "maxItems": 40, "items": {"type": "string",
                                                               "maxLength": 100}}}
                try:
                    await engine.add_request(f"medium-{n}", PROMPT, greedy(
                        1, structured_outputs=StructuredOutputsParams(json=schema)))
                except ValueError:
                    pass
                engine.abort(f"medium-{n}")
                n += 1
            return n

        medium = asyncio.ensure_future(medium_grammars())
        await asyncio.sleep(0.5)
        lat = await plain_latencies(engine, args, "beside-medium")
        stop.set()
        summary("while distinct medium grammars compile (sandbox + engine)", lat, base)
        print(f"    ({await medium} grammars compiled meanwhile)")

        rng = random.Random(0)
        words = [" ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(3))
                 for _ in range(args.bad_words)]
        for tag, kw in (("beside a long plain request", {}),
                        (f"beside a long request with {args.bad_words} bad words",
                         {"bad_words": words})):
            other = asyncio.ensure_future(generate(engine, f"other-{tag}", greedy(900, **kw)))
            await asyncio.sleep(0.5)
            lat = await plain_latencies(engine, args, f"beside-{len(kw)}")
            other.cancel()
            engine.abort(f"other-{tag}")
            if not kw:
                pair = lat
                summary(tag, lat, base)
            else:
                summary(tag, lat, pair)
        huge = [f"w{i}" for i in range(30_000)]
        t = time.perf_counter()
        try:
            await engine.add_request("huge", PROMPT, greedy(4, bad_words=huge))
            print("  30,000 bad words: accepted")
            engine.abort("huge")
        except ValueError as e:
            print(f"  30,000 bad words: refused in {time.perf_counter() - t:.3f} s: {e}")
        summary("alone, again", await plain_latencies(engine, args, "alone-again"), base)
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["compile", "interference", "both"], default="both")
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded SmolLM2)")
    p.add_argument("--plain-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bad-words", type=int, default=1000,
                   help="bad words of the concurrent request (the engine's cap is raised to "
                        "it when above the default 1000)")
    p.add_argument("--compile-limit", type=float, default=15.0,
                   help="CPU seconds a grammar may compile (long enough that the slow schema "
                        "compiles throughout its measurement)")
    args = p.parse_args()
    print(f"cores: {len(os.sched_getaffinity(0))}", flush=True)
    if args.part in ("compile", "both"):
        compile_times(args)
    if args.part in ("interference", "both"):
        asyncio.run(interference(args))


if __name__ == "__main__":
    main()
