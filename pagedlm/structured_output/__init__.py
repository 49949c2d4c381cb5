"""Structured outputs: grammars that constrain what a request may generate.

The engine owns one StructuredOutputManager (manager.py). A request's StructuredOutputsParams is
validated when it is added and compiled on a background thread, cached by its spec; the request
waits in the scheduler until its grammar is ready, without holding anything else back. Each step,
the manager fills a token bitmask (bitmask.py) for the sampled rows that have a grammar; it
travels with the step to the workers, where the sampler masks those rows' logits in one batched
operation. As tokens are accepted, each sequence's matcher advances; a sequence whose grammar is
complete is finished.

The grammar library sits behind backend.py's interface; xgrammar_backend.py implements it.
Nothing here is imported unless a request asks for structured output.
"""
