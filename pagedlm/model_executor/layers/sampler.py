"""The Sampler: logits of the rows to sample -> next tokens (and their logprobs).

Vectorised over the batch; each optional stage runs only when some row asks for it, so an
all-greedy batch costs one argmax. Logprobs are those of the raw model distribution.

With drafts (speculative decoding, meta.draft), a speculating sequence's rows go through the
same processing, and rejection_sampler.py decides from their distributions which drafts are
accepted; the other rows sample as without drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm import kernels
from pagedlm.kernels import fused_ops
from pagedlm.model_executor.layers.rejection_sampler import (
    DraftMetadata,
    DraftSpan,
    accept_greedy,
    accept_random,
    inverse_cdf,
)
from pagedlm.model_executor.layers.token_constraints import apply_token_constraints
from pagedlm.model_io import SamplerOutput
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask


@dataclass
class SamplingMetadata:
    params: list[SamplingParams]  # one per row
    generators: list[torch.Generator | None]  # per row: the request's seeded generator
    # Per row; filled only for rows with penalties or min_tokens (empty otherwise).
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]  # per row, for the repetition penalty
    stop_ids: list[frozenset[int]]  # per row: ids masked while under min_tokens
    all_greedy: bool
    max_num_logprobs: int  # -1 when no row wants logprobs
    any_token_constraints: bool = False  # some row has logit_bias, allowed_token_ids, bad_words
    grammar_bitmask: GrammarBitmask | None = None  # rows with a grammar: their allowed tokens
    # Speculating sequences' rows: verify their drafts (rejection sampling) instead.
    draft: DraftMetadata | None = None
    # Some row has penalties / a min_tokens, where the builder knows (None: scan the rows).
    any_penalties: bool | None = None
    any_min_tokens: bool | None = None


class Sampler(torch.nn.Module):

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator  # for unseeded random rows

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: float32 [rows, vocab], as compute_logits returns them on every device."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs >= 0 else None
        logits = _process(logits, meta)
        if meta.draft is not None:
            sampled, num_emitted = self._verify(logits, meta, meta.draft.spans)
            out = _gather_logprobs(sampled, raw_logprobs, meta.max_num_logprobs)
            out.num_emitted = num_emitted
            return out
        return _gather_logprobs(self._draw(logits, meta), raw_logprobs, meta.max_num_logprobs)

    def sample_ids(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The sampled ids, left on the logits' device (no host copy, so no wait for the
        device): multi-step decoding feeds them to its next iteration. For rows without
        logprobs or drafts."""
        if meta.max_num_logprobs >= 0 or meta.draft is not None:
            raise ValueError("sample_ids samples rows without logprobs or drafts")
        return self._draw(_process(logits, meta), meta)

    def _draw(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return greedy_argmax(logits)
        return self._sample(logits, meta.params, meta.generators)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        # The argmax costs a pass over the logits (about 1 ms at 128 rows of SmolLM2's 49k
        # vocabulary with the native kernel): only when some row needs it.
        greedy = [p.greedy for p in params]
        greedy_tokens = greedy_argmax(logits) if any(greedy) else None
        probs = _target_probs(logits, params)
        # Inverse-CDF sampling: one uniform draw per row. Seeded rows draw from their own
        # generator, so their result does not depend on what else is in the batch.
        # The generators live on the logits' device (ModelRunner makes them there).
        dev = probs.device
        u = torch.empty(len(params), dtype=probs.dtype, device=dev)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator, dtype=probs.dtype,
                                     device=dev)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, dtype=probs.dtype, device=dev)[0]
        random_tokens = inverse_cdf(probs, u)
        if greedy_tokens is None:
            return random_tokens
        return torch.where(torch.tensor(greedy, device=dev), greedy_tokens, random_tokens)

    def _verify(self, logits: torch.Tensor, meta: SamplingMetadata, spans: list[DraftSpan]
                ) -> tuple[torch.Tensor, list[int]]:
        """Sampled tokens of every row (a span's emitted tokens in its first rows) and the
        number each span emits."""
        sampled = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        in_span = [False] * logits.shape[0]  # on the host: no device sync to find the rest
        for s in spans:
            in_span[s.first_row:s.rows.stop] = [True] * (s.rows.stop - s.first_row)
        other = [i for i, x in enumerate(in_span) if not x]
        if other:
            params = [meta.params[i] for i in other]
            sub = logits[other]
            sampled[other] = (greedy_argmax(sub) if all(p.greedy for p in params) else
                              self._sample(sub, params, [meta.generators[i] for i in other]))
        num_emitted = [0] * len(spans)
        for greedy in (True, False):
            which = [i for i, s in enumerate(spans) if meta.params[s.first_row].greedy == greedy]
            if not which:
                continue
            group = [spans[i] for i in which]
            rows = [r for s in group for r in s.rows]
            # Gathering rows copies their logits (8 MB for 40 rows of a 49k vocabulary): only
            # where some rows are not theirs.
            mine = logits if rows == list(range(logits.shape[0])) else logits[rows]
            if greedy:
                tokens = greedy_argmax(mine)
                emitted = accept_greedy(tokens, group)
            else:
                probs = _target_probs(mine, [meta.params[r] for r in rows])
                u = self._span_uniforms(group, meta.generators, probs.dtype)
                tokens, emitted = accept_random(probs, group, u)
            sampled[rows] = tokens
            for i, e in zip(which, emitted.tolist()):
                num_emitted[i] = e
        return sampled, num_emitted

    def _span_uniforms(self, spans: list[DraftSpan], generators: list[torch.Generator | None],
                       dtype: torch.dtype) -> torch.Tensor:
        """[S, M+1]: span i's m+1 draws from its request's generator (self.generator when
        unseeded), its first m in columns 0..m-1 (one per draft), its last in column M."""
        longest = max(len(s.token_ids) for s in spans)
        dev = self.generator.device  # the model's (ModelRunner makes every generator there)
        u = torch.ones(len(spans), longest + 1, dtype=dtype, device=dev)
        gens = [generators[s.first_row] for s in spans]
        unseeded = [i for i, g in enumerate(gens) if g is None]
        if unseeded:
            # One call for all of them, scattered: draw k of span i to column k, or M if last.
            # The column of each draw is worked out on the host (a few ints), then moved once.
            m = [len(spans[i].token_ids) for i in unseeded]
            span_of = [j for j, mj in enumerate(m) for _ in range(mj + 1)]
            col = [k if k < mj else longest for mj in m for k in range(mj + 1)]
            rows = torch.tensor([unseeded[j] for j in span_of], device=dev)
            u[rows, torch.tensor(col, device=dev)] = torch.rand(
                len(col), generator=self.generator, dtype=dtype, device=dev)
        for i, (s, g) in enumerate(zip(spans, gens)):
            if g is not None:
                m = len(s.token_ids)
                draws = torch.rand(m + 1, generator=g, dtype=dtype, device=dev)
                u[i, :m] = draws[:m]
                u[i, longest] = draws[m]
        return u


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same indices (first maximum, first NaN), through the native
    kernel for CPU float32 logits: torch's CPU argmax reads them at ~6 GB/s (4 ms a step at 128
    rows of SmolLM2's 49k vocabulary on 2 threads), the kernel at about a plain read's speed
    (see argmax_rows_f32 in csrc/fused_ops.c)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1 and logits.shape[1] > 0 and kernels.available()):
        return fused_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalties, min_tokens, token constraints and the grammar: the logits each row samples
    from (before temperature)."""
    if (meta.any_penalties if meta.any_penalties is not None
            else any(p.has_penalties for p in meta.params)):
        logits = _apply_penalties(logits, meta)
    if meta.any_min_tokens is not False and any(
            p.min_tokens and len(o) < p.min_tokens
            for p, o in zip(meta.params, meta.output_token_ids)):
        logits = _mask_stop_tokens(logits, meta)
    if meta.any_token_constraints:
        logits = apply_token_constraints(logits, meta.params, meta.output_token_ids)
    if meta.grammar_bitmask is not None:
        logits = apply_grammar_bitmask(logits, meta.grammar_bitmask)
    return logits


def _target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution random rows draw from: temperature, top-k/top-p, min-p (greedy rows
    at temperature 1, untruncated unless asked)."""
    # The division costs a pass over the logits (1 ms at 128 rows of SmolLM2's 49k
    # vocabulary): only when some row needs it.
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, dtype=logits.dtype,
                                       device=logits.device).unsqueeze(1)
    if any(p.top_k or p.top_p < 1.0 for p in params):
        logits = _apply_top_k_top_p(logits, params)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits.softmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    dev = logits.device
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=dev)
    kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    rows, vocab = logits.shape
    dev = logits.device
    logits = logits.clone()
    counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=dev)
    width = max((len(o) for o in meta.output_token_ids), default=0)
    if width:
        ids = torch.tensor([o + [vocab] * (width - len(o)) for o in meta.output_token_ids],
                           device=dev)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = counts > 0
    for i, prompt in enumerate(meta.prompt_token_ids):
        if meta.params[i].repetition_penalty != 1.0:
            seen[i, prompt] = True
    rep = torch.tensor([p.repetition_penalty for p in meta.params], dtype=logits.dtype,
                       device=dev)
    rep = rep.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([p.frequency_penalty for p in meta.params], dtype=logits.dtype,
                        device=dev)
    pres = torch.tensor([p.presence_penalty for p in meta.params], dtype=logits.dtype,
                        device=dev)
    return logits - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0)


def _mask_stop_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    logits = logits.clone()
    for i, (p, out) in enumerate(zip(meta.params, meta.output_token_ids)):
        if len(out) < p.min_tokens and meta.stop_ids[i]:
            logits[i, list(meta.stop_ids[i])] = float("-inf")
    return logits


def _gather_logprobs(sampled: torch.Tensor, raw: torch.Tensor | None, k: int) -> SamplerOutput:
    if raw is None:
        return SamplerOutput(sampled.tolist(), None, None, None, None)
    chosen = raw.gather(1, sampled.unsqueeze(1))
    ranks = (raw > chosen).sum(dim=-1) + 1
    top_ids = top_vals = None
    if k > 0:
        top = raw.topk(k, dim=-1)
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
    return SamplerOutput(sampled.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(),
                         top_ids, top_vals)
