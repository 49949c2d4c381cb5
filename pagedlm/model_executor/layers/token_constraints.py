"""logit_bias, allowed_token_ids and bad_words in the form the sampler applies them.

Built once per request when it is added (linear in its lists), so that a step costs a few
tensor operations per constrained row however long the lists are: the biases one index_put, the
allowed ids one mask, single-token bad words one index assignment, and multi-token bad words one
comparison per distinct prefix length of a (words, prefix length) tensor against the row's
last output tokens.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from pagedlm.sampling_params import SamplingParams


@dataclass
class TokenConstraints:
    bias_ids: torch.Tensor | None = None  # int64 token ids
    bias_values: torch.Tensor | None = None  # float32, added to those ids' logits
    allowed_ids: torch.Tensor | None = None  # int64, deduplicated: nothing else is sampled
    allowed: frozenset[int] | None = None  # the same, for the output processor's check
    banned_ids: torch.Tensor | None = None  # int64: the single-token bad words, always banned
    # Multi-token bad words by prefix length l (ascending): (prefixes (words, l), last tokens
    # (words,)); a word's last token is banned where the output ends with its prefix.
    prefix_groups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    longest_prefix: int = 0

    @classmethod
    def build(cls, params: SamplingParams, vocab_size: int) -> "TokenConstraints | None":
        """None when the request has no constraint. Token ids must be below vocab_size (the
        engine checks logit_bias and allowed_token_ids); a bad word with a token past it could
        never be generated and is dropped."""
        c = cls()
        if params.logit_bias:
            c.bias_ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long)
            c.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if params.allowed_token_ids:
            c.allowed = frozenset(params.allowed_token_ids)
            c.allowed_ids = torch.tensor(sorted(c.allowed), dtype=torch.long)
        single: set[int] = set()
        by_len: dict[int, dict[tuple[int, ...], None]] = defaultdict(dict)  # ordered sets
        for word in params.bad_words_token_ids or ():
            if not word or max(word) >= vocab_size or min(word) < 0:
                continue
            if len(word) == 1:
                single.add(word[0])
            else:
                by_len[len(word) - 1][tuple(word)] = None
        if single:
            c.banned_ids = torch.tensor(sorted(single), dtype=torch.long)
        for length in sorted(by_len):
            words = torch.tensor(list(by_len[length]), dtype=torch.long)
            c.prefix_groups.append((words[:, :-1].contiguous(), words[:, -1].contiguous()))
            c.longest_prefix = length
        if (c.bias_ids is None and c.allowed_ids is None and c.banned_ids is None
                and not c.prefix_groups):
            return None
        return c

    def banned_after(self, output_token_ids: list[int]) -> torch.Tensor | None:
        """The last tokens of the multi-token bad words whose prefix the output ends with."""
        n = min(self.longest_prefix, len(output_token_ids))
        if n == 0:
            return None
        tail = torch.tensor(output_token_ids[len(output_token_ids) - n:], dtype=torch.long)
        hits = []
        for prefixes, last in self.prefix_groups:
            length = prefixes.shape[1]
            if length > n:
                break
            hits.append(last[(prefixes == tail[n - length:]).all(dim=1)])
        return torch.cat(hits) if hits else None


def constraints_of(params: SamplingParams, vocab_size: int) -> TokenConstraints | None:
    """The request's constraints: built when it was added, or here for params that did not go
    through the engine (built each call, then)."""
    if params.token_constraints is not None:
        return params.token_constraints
    if not params.has_token_constraints:
        return None
    return TokenConstraints.build(params, vocab_size)


def apply_token_constraints(logits: torch.Tensor, params: list[SamplingParams],
                            output_token_ids: list[list[int]]) -> torch.Tensor:
    """A copy of logits with every row's biases added, then its allow list and bad words
    masked (-inf)."""
    logits = logits.clone()
    dev = logits.device
    bias_rows, bias_ids, bias_vals = [], [], []
    allow_rows, allow_ids = [], []
    ban_rows, ban_ids = [], []
    for i, p in enumerate(params):
        c = constraints_of(p, logits.shape[1])
        if c is None:
            continue
        if c.bias_ids is not None:
            bias_rows.append(torch.full((len(c.bias_ids),), i, dtype=torch.long))
            bias_ids.append(c.bias_ids)
            bias_vals.append(c.bias_values)
        if c.allowed_ids is not None:
            allow_rows.append(torch.full((len(c.allowed_ids),), len(allow_ids), dtype=torch.long))
            allow_ids.append((i, c.allowed_ids))
        banned = [c.banned_ids] if c.banned_ids is not None else []
        if c.prefix_groups and (after := c.banned_after(output_token_ids[i])) is not None:
            banned.append(after)
        for ids in banned:
            ban_rows.append(torch.full((len(ids),), i, dtype=torch.long))
            ban_ids.append(ids)
    if bias_rows:
        logits.index_put_((torch.cat(bias_rows).to(dev), torch.cat(bias_ids).to(dev)),
                          torch.cat(bias_vals).to(dev, logits.dtype), accumulate=True)
    if allow_ids:
        rows = torch.tensor([i for i, _ in allow_ids], device=dev)
        keep = torch.zeros(len(allow_ids), logits.shape[1], dtype=torch.bool, device=dev)
        cols = torch.cat([ids for _, ids in allow_ids])
        keep[torch.cat(allow_rows).to(dev), cols.to(dev)] = True
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    if ban_rows:
        logits[torch.cat(ban_rows).to(dev), torch.cat(ban_ids).to(dev)] = float("-inf")
    return logits
