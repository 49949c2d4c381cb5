"""Speculative decoding: proposers that guess the next tokens of a sequence, for the target
model to verify in one pass (issue 34; the design is in the proposer module's docstring)."""
