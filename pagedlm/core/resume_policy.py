"""How a group preempted by recompute comes back: the Scheduler's rules for the prefill that
replaces its lost KV (core/scheduler.py asks; the BlockManager does the block arithmetic).

- An n > 1 group computes its prompt's full blocks once, with its first sequence, and the others
  share them, as they did when they forked from it (any mode).
- Under --deterministic a sequence holds its last token back for the decode after the
  prefill, so that the step that samples it is the one that would have run without the
  preemption (speculating as it would have); the sequences of an n > 1 group decode from the
  same step again; and a group comes back only with room for that decode.
"""
from __future__ import annotations

from pagedlm.core.block_manager import BlockManager
from pagedlm.core.spec_policy import SpecPolicy
from pagedlm.sequence import Sequence, SequenceGroup


class ResumePolicy:

    def __init__(self, block_manager: BlockManager, spec_policy: SpecPolicy | None,
                 deterministic: bool) -> None:
        self.block_manager = block_manager
        self.spec_policy = spec_policy
        self.deterministic = deterministic

    def prompt_leader(self, seqs: list[Sequence]) -> tuple[Sequence, int] | None:
        """An n > 1 group that recompute preempted computes its prompt's full blocks once
        again: its first sequence alone, then the others share them (`join_leader`), as they
        shared them when they forked from it. Prefilled each on its own, the group needed n
        copies of its prompt, and a long prompt's copies could exceed the cache: the group
        then ended 'length' although it had run (measured: 24 blocks, n = 4, a 143-token
        prompt: 2 of 9 tokens). (its first sequence, the tokens of the prompt's full blocks)
        while the others wait for them; None otherwise."""
        leader = seqs[0]
        shared = self.block_manager.shared_prompt_tokens(seqs)
        if (not shared or leader.num_computed_tokens >= shared
                or seqs[1].block_table or seqs[1].num_computed_tokens):
            return None
        return leader, shared

    def room_to_share(self, group: SequenceGroup, seqs: list[Sequence], shared: int) -> bool:
        """Whether the cache has room now for the whole group once its sequences share the
        prompt's first `shared` tokens, and for each one's next decode (1 + k slots): its
        first sequence alone is admitted to compute them, and the others join it later."""
        return self.block_manager.can_share_prompt(
            [len(s.token_ids) + 1 + k for s, k in zip(seqs, self._lookahead(group, seqs))],
            shared)

    def join_leader(self, group: SequenceGroup) -> None:
        """After a step: where a group's first sequence has computed the prompt's full blocks
        again (`prompt_leader`), the others take them."""
        seqs = group.unfinished_seqs()
        if len(seqs) < 2:
            return
        leader = seqs[0]
        shared = self.block_manager.shared_prompt_tokens(seqs)
        if leader.num_computed_tokens < shared:
            return
        for s in seqs[1:]:
            if not s.block_table and not s.num_computed_tokens:
                self.block_manager.share_prompt(leader, s, shared // self.block_manager.block_size)

    def hold_back(self, seqs: list[Sequence], remaining: list[int]
                  ) -> tuple[list[Sequence], list[int]]:
        """A running group's sequences and tokens less what held_back holds. An n > 1
        group's sequences draw from one generator, in a step's row order: one whose prefill
        is done waits for the others, so that all decode from the same step again."""
        held = [self.held_back(s) for s in seqs]
        if not any(held):
            return seqs, remaining
        if len(seqs) == 1:
            return seqs, [remaining[0] - 1]
        return ([s for s, h in zip(seqs, held) if h],
                [n - 1 for n, h in zip(remaining, held) if h])

    def held_back(self, seq: Sequence) -> int:
        """1 where a sequence comes back from a recompute preemption under --deterministic:
        its prefill computes all but its last token, which its next step decodes (with its
        drafts, speculating), as that step would have run without the preemption. A prefill
        that sampled the last token drew the request's seeded generator once where a
        speculating step draws 1 + k times, and the sequences of an n > 1 group, prefilled in
        chunks over several steps, drew in another order; either way the tokens after it
        changed with the load (measured). Else 0."""
        return int(self.deterministic and seq.num_output_tokens > 0
                   and len(seq.token_ids) - seq.num_computed_tokens > 1)

    def room_to_resume(self, group: SequenceGroup, seqs: list[Sequence], remaining: list[int],
                       prefixes: dict[Sequence, list[int]]) -> bool:
        """Whether a group holding its last tokens back has room for the prefill and the
        decode after it (1 + k slots each; k = 0 where the whole cache could never hold the
        group's, as its decode then gives them up, so that it never waits for good): admitted
        without, that decode preempted it again and the prefill was in vain, each time the
        cache was short (measured: 2-3x the preemptions of the same batch)."""
        ks = self._lookahead(group, seqs)
        return self.block_manager.can_allocate_slots(
            seqs, [n + 1 + k for n, k in zip(remaining, ks)], admission=True, prefixes=prefixes)

    def _lookahead(self, group: SequenceGroup, seqs: list[Sequence]) -> list[int]:
        """Each sequence's k for its next decode (0 without speculation, or where the whole
        cache could never hold the group's slots: its decode then gives them up)."""
        if self.spec_policy is None:
            return [0] * len(seqs)
        return self.spec_policy.fitting_lookahead(group, seqs,
                                                  self.block_manager.can_ever_fit_group)
