"""Structured outputs: grammars that constrain what a request may generate.

The engine owns one StructuredOutputManager (manager.py). A request's StructuredOutputsParams is
bounded in size when it is built (limits.py), compiled first in a child process that is killed
past the compile time limit (sandbox.py), then in the engine's process on a background thread,
and cached by its spec. The async engine waits for that before the request reaches the engine
thread; a request added to LLMEngine directly waits in the scheduler until its grammar is
ready, without holding anything else back. Each step,
the manager fills a token bitmask (bitmask.py) for the sampled rows that have a grammar; it
travels with the step to the workers, where the sampler masks those rows' logits in one batched
operation. As tokens are accepted, each sequence's matcher advances; a sequence whose grammar is
complete is finished.

The grammar library sits behind backend.py's interface; xgrammar_backend.py implements it.
Nothing here is imported unless a request asks for structured output.
"""
