"""What the Scheduler decides for one step (SchedulerOutput, each group's ScheduledGroup) and
the counters it keeps (SchedulerStats): the data the engine, the output processor, the workers'
message builder (sched_output.py) and the metrics read, as vLLM's v1/core/sched/output.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledGroup:
    group: SequenceGroup
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per seq: tokens computed this step
    # per seq: tokens to sample after this step; 0 mid-prompt, best_of when a prompt forks.
    num_samples: list[int] = field(default_factory=list)
    # per seq: speculative lookahead slots reserved past its one new token (0: none).
    num_lookahead: list[int] | None = None

    def __post_init__(self) -> None:
        seqs = self.seqs
        if len(seqs) == 1:  # most groups: no comprehension (its frame costs as much as this)
            self.num_samples = [self.group.num_samples(seqs[0], self.num_new_tokens[0])]
        else:
            self.num_samples = [self.group.num_samples(s, n)
                                for s, n in zip(seqs, self.num_new_tokens)]
        if self.num_lookahead is None:
            self.num_lookahead = [0] * len(seqs)


@dataclass
class SchedulerOutput:
    scheduled_groups: list[ScheduledGroup] = field(default_factory=list)
    num_prefill_groups: int = 0
    num_batched_tokens: int = 0
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on device
    # Multi-step decoding: model iterations this step (> 1 only for a step of decodes, whose
    # sequences hold num_lookahead slots for the iterations after the first).
    num_steps: int = 1
    # Groups that can never be scheduled (they outgrew the whole cache or budget): finished.
    ignored_groups: list[SequenceGroup] = field(default_factory=list)
    running_queue_size: int = 0
    waiting_queue_size: int = 0
    swapped_queue_size: int = 0

    @property
    def has_cache_ops(self) -> bool:
        return bool(self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled_groups or self.ignored_groups or self.has_cache_ops)


@dataclass
class SchedulerStats:
    """The scheduler's counters since start-up (the only place they are kept)."""
    num_preemptions: int = 0  # by recompute or swap
    num_swapped_out: int = 0  # of those, groups moved to the host pool
    num_swapped_in: int = 0
    num_ignored: int = 0  # groups finished unscheduled: they could never fit
    num_lora_waits: int = 0  # steps x groups held back because no adapter slot was free
    max_step_loras: int = 0  # most distinct adapters in one step
    # Speculative decoding: drafts verified, of those accepted, and sequence-steps that
    # verified at least one (acceptance rate = accepted / drafts; mean accepted length =
    # 1 + accepted / verifies, the tokens a verifying sequence-step emits).
    spec_num_drafts: int = 0
    spec_num_accepted: int = 0
    spec_num_verifies: int = 0
