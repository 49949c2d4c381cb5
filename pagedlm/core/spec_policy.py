"""How far each decoding sequence speculates this step (k lookahead slots; 0: plain decode).

Per request, so it is visible and deterministic-safe:
- no speculation for requests with a grammar (structured outputs: drafts are not checked
  against the grammar, the request decodes plainly), nor for prompts still being prefilled;
- k never reaches past max_tokens or max_model_len (those slots could never be used);
- back-off: a verification that accepts nothing halves the sequence's k; at 0 it decodes
  plainly for its next backoff_retry_steps tokens, then tries k = 1 again; a
  verification that accepts every draft raises k by one (up to num_speculative_tokens). This
  depends only on the sequence's own tokens: counted in decode steps, a recompute
  preemption's prefill (one plain token, not a decode step) delayed the retry by a step, and
  with it the seeded generator's draws and the tokens after it (measured under
  --deterministic).
And one rule by load, off under --deterministic (a seeded request's output must not depend on
the others): with more than max_batch_for_spec decoding sequences in a step, none speculates,
since a large batch is compute-bound on a CPU and k verification rows per sequence cost more
than they save.
"""
from __future__ import annotations

from collections.abc import Callable

from pagedlm.sequence import Sequence, SequenceGroup
from pagedlm.speculative_config import SpeculativeConfig


class SpecPolicy:

    def __init__(self, config: SpeculativeConfig, deterministic: bool, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.deterministic = deterministic
        self.max_model_len = max_model_len
        # A sequence's 1 + k tokens must fit one step's budget on their own.
        self.max_k = min(config.num_speculative_tokens, max_num_batched_tokens - 1)

    def batch_allows(self, num_decoding: int) -> bool:
        return self.deterministic or num_decoding <= self.config.max_batch_for_spec

    def lookahead(self, group: SequenceGroup, seq: Sequence) -> int:
        """The sequence's k this step, if it is scheduled (`scheduled` then counts it)."""
        if group.structured_output is not None or seq.num_output_tokens == 0:
            # A prompt's last token is a decode by shape when chunks leave it alone in a step;
            # speculating there drew the first token by rejection sampling where a whole
            # prefill samples it plainly (a seeded request's first token followed the chunking).
            return 0
        if seq.spec_k is None:
            seq.spec_k = self.max_k
        k = seq.spec_k or (1 if seq.num_output_tokens >= seq.spec_retry_at else 0)
        # Tokens it may still emit after the first, and positions left in the model.
        left = group.sampling_params.max_tokens - seq.num_output_tokens - 1
        room = self.max_model_len - len(seq.token_ids)
        return max(0, min(k, left, room))

    def fitting_lookahead(self, group: SequenceGroup, seqs: list[Sequence],
                          can_ever_fit: Callable[[list[Sequence], list[int]], bool]
                          ) -> list[int]:
        """The sequences' k, all 0 where the whole cache could never hold their tokens and
        lookahead slots together (those slots are given up rather than waited for)."""
        ks = [self.lookahead(group, s) for s in seqs]
        if any(ks) and not can_ever_fit(seqs, [len(s.token_ids) + k for s, k in zip(seqs, ks)]):
            return [0] * len(seqs)
        return ks

    def update(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a verification of num_drafts >= 1 drafts."""
        if seq.spec_k is None:
            return
        seq.spec_k = seq.spec_k or 1  # a backed-off sequence's retry verified k = 1
        if num_accepted == 0:
            seq.spec_k //= 2
            if seq.spec_k == 0:
                seq.spec_retry_at = seq.num_output_tokens + self.config.backoff_retry_steps
        elif num_accepted == num_drafts:
            seq.spec_k = min(self.max_k, seq.spec_k + 1)
