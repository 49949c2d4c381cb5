"""SamplingMetadata for the Sampler on hand-built logits: one row per params entry, histories,
prompts, generators and stop ids defaulting to none, and optionally speculative spans."""
from __future__ import annotations

from pagedlm.model_executor.layers.sampler import DraftMetadata, SamplingMetadata


def make_meta(params, outputs=None, prompts=None, generators=None, stop_ids=None, spans=None):
    rows = len(params)
    want = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        params=list(params),
        generators=list(generators) if generators is not None else [None] * rows,
        output_token_ids=[list(o) for o in outputs] if outputs is not None else [[]] * rows,
        prompt_token_ids=[list(p) for p in prompts] if prompts is not None else [[0]] * rows,
        stop_ids=list(stop_ids) if stop_ids is not None else [frozenset()] * rows,
        all_greedy=all(p.greedy for p in params),
        max_num_logprobs=max(want, default=-1),
        any_token_constraints=any(p.has_token_constraints for p in params),
        draft=DraftMetadata(spans) if spans is not None else None,
    )
