"""The Scheduler: decides, each step, which sequences run and on how many tokens.

Running groups go first (one decode token per sequence), then waiting groups are admitted in
arrival order while the token budget, the sequence budget and the free KV blocks allow. When a
running sequence needs a block and none is free, the most recently arrived running group is
preempted by recompute: its blocks are freed and it goes back to the front of the waiting queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedlm.config import SchedulerConfig
from pagedlm.core.block_manager import BlockManager
from pagedlm.sequence import Sequence, SequenceGroup, SequenceStatus


def is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """One new token after a cached context: attention batches these; the rest are prefills."""
    return num_new_tokens == 1 and seq.num_computed_tokens > 0


@dataclass
class ScheduledGroup:
    group: SequenceGroup
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per seq: tokens computed this step
    # per seq: tokens to sample after this step; 0 mid-prompt, n when a prompt forks into n.
    num_samples: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.group.sampling_params.n
        fresh = len(self.group.seqs) == 1
        self.num_samples = [
            0 if s.num_computed_tokens + k < len(s.token_ids)
            else (n if fresh and s.num_output_tokens == 0 else 1)
            for s, k in zip(self.seqs, self.num_new_tokens)]


@dataclass
class SchedulerOutput:
    scheduled_groups: list[ScheduledGroup]
    num_prefill_groups: int
    num_batched_tokens: int
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Groups that can never be scheduled (they outgrew the whole cache or budget): finished.
    ignored_groups: list[SequenceGroup] = field(default_factory=list)
    preempted: int = 0
    running_queue_size: int = 0
    waiting_queue_size: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_groups and not self.ignored_groups


class Scheduler:

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0

    def add_seq_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_seqs = 0
        scheduled: list[ScheduledGroup] = []
        copies: list[tuple[int, int]] = []
        preempted = 0

        # 1. Running groups, oldest first; the youngest is preempted when blocks run out.
        still_running: list[SequenceGroup] = []
        queue = deque(self.running)
        while queue:
            group = queue.popleft()
            seqs = group.unfinished_seqs()
            tokens = [s.num_uncomputed_tokens for s in seqs]
            if sum(tokens) > budget:
                still_running.append(group)  # rare: wait for next step's budget
                continue
            blocks = sum(self.block_manager.blocks_needed(s, n) for s, n in zip(seqs, tokens))
            preempted_self = False
            while not self.block_manager.can_allocate(blocks):
                victim = queue.pop() if queue else group
                self._preempt(victim)
                preempted += 1
                if victim is group:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            for s, n in zip(seqs, tokens):
                copies += self.block_manager.allocate(s, n)
            scheduled.append(ScheduledGroup(group, seqs, tokens))
            still_running.append(group)
            budget -= sum(tokens)
            num_seqs += len(seqs)
        self.running = still_running

        # 2. Admit waiting groups in order, unless we just had to preempt (no room to grow).
        num_prefill_groups = 0
        ignored: list[SequenceGroup] = []
        while self.waiting and not preempted:
            group = self.waiting[0]
            seqs = group.unfinished_seqs()
            tokens = [s.num_uncomputed_tokens for s in seqs]
            blocks = sum(self.block_manager.blocks_needed(s, n) for s, n in zip(seqs, tokens))
            if not self._can_ever_fit(sum(tokens), blocks):
                # Waiting would be forever (a sequence grew past the whole cache, say):
                # finish it with what it has, as the seeds' ignored_seq_groups.
                self.waiting.popleft()
                for s in seqs:
                    s.status = SequenceStatus.FINISHED_LENGTH
                ignored.append(group)
                continue
            if sum(tokens) > budget or num_seqs + group.max_num_seqs > self.config.max_num_seqs:
                break
            if not self.block_manager.can_allocate(blocks, admission=True):
                break
            self.waiting.popleft()
            for s, n in zip(seqs, tokens):
                copies += self.block_manager.allocate(s, n)
                s.status = SequenceStatus.RUNNING
            scheduled.append(ScheduledGroup(group, seqs, tokens))
            self.running.append(group)
            num_prefill_groups += 1
            budget -= sum(tokens)
            num_seqs += group.max_num_seqs

        self.num_preemptions += preempted
        return SchedulerOutput(
            scheduled_groups=scheduled, num_prefill_groups=num_prefill_groups,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_copy=copies, ignored_groups=ignored, preempted=preempted,
            running_queue_size=len(self.running), waiting_queue_size=len(self.waiting))

    def _can_ever_fit(self, num_tokens: int, num_blocks: int) -> bool:
        bm = self.block_manager
        return (num_tokens <= self.config.max_num_batched_tokens
                and num_blocks <= bm.num_blocks - bm.watermark_blocks)

    def _preempt(self, group: SequenceGroup) -> None:
        """Recompute preemption: drop the group's KV and queue it to be prefilled again."""
        for seq in group.unfinished_seqs():
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)

    def update_from_output(self, output: SchedulerOutput) -> None:
        """The step's tokens are now in the KV cache."""
        for sg in output.scheduled_groups:
            for seq, n in zip(sg.seqs, sg.num_new_tokens):
                seq.num_computed_tokens += n

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.block_manager.free(seq)

    def free_finished_groups(self) -> None:
        self.running = [g for g in self.running if not g.is_finished()]

    def abort(self, request_ids: set[str]) -> list[SequenceGroup]:
        aborted = []
        for queue in (self.waiting, self.running):
            for group in [g for g in queue if g.request_id in request_ids]:
                queue.remove(group)
                for seq in group.unfinished_seqs():
                    self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
                aborted.append(group)
        return aborted
