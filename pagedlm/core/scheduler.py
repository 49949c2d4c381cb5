"""The Scheduler: decides, each step, which sequences run and on how many tokens.

Three queues, as in the seeds: waiting (new, or preempted by recompute), running, and swapped
(preempted by swap: their KV blocks wait in the host pool). Groups are ordered by arrival, or by
(priority, arrival) under the priority policy. Each step:

1. Priority policy only: running groups of lower priority than the best waiting group are
   preempted while that group could not otherwise be admitted.
2. Running groups, decodes first (so running requests keep their pace), then prompts still being
   prefilled, each within the token budget (chunked prefill splits a long prompt over steps).
   A group that needs a block when none is free preempts the worst running group not yet
   scheduled this step (the youngest, or the lowest priority), which may be itself.
3. If nothing had to be preempted: swapped groups come back first (blocks_to_swap_in).
4. If nothing is still swapped out: waiting groups are admitted in order, each starting from its
   longest cached prefix, while the budgets and the free blocks (less a watermark) allow.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedlm.config import SchedulerConfig
from pagedlm.core.block_manager import BlockManager
from pagedlm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedlm.utils import cdiv


def is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """One new token after a cached context: attention batches these; the rest are prefills."""
    return num_new_tokens == 1 and seq.num_computed_tokens > 0


@dataclass
class ScheduledGroup:
    group: SequenceGroup
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per seq: tokens computed this step
    # per seq: tokens to sample after this step; 0 mid-prompt, best_of when a prompt forks.
    num_samples: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        sp = self.group.sampling_params
        # Beam search forks in the output processor, from one sample per beam.
        first = 1 if sp.use_beam_search else sp.best_of
        fresh = len(self.group.seqs) == 1
        self.num_samples = [
            0 if s.num_computed_tokens + k < len(s.token_ids)
            else (first if fresh and s.num_output_tokens == 0 else 1)
            for s, k in zip(self.seqs, self.num_new_tokens)]


@dataclass
class SchedulerOutput:
    scheduled_groups: list[ScheduledGroup] = field(default_factory=list)
    num_prefill_groups: int = 0
    num_batched_tokens: int = 0
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on device
    # Groups that can never be scheduled (they outgrew the whole cache or budget): finished.
    ignored_groups: list[SequenceGroup] = field(default_factory=list)
    preempted: int = 0  # groups preempted this step, by recompute or swap
    swapped_out: int = 0  # of those, by swap
    swapped_in: int = 0
    running_queue_size: int = 0
    waiting_queue_size: int = 0
    swapped_queue_size: int = 0

    @property
    def has_cache_ops(self) -> bool:
        return bool(self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled_groups or self.ignored_groups or self.has_cache_ops)


class Scheduler:

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self._arrivals = 0

    def add_seq_group(self, group: SequenceGroup) -> None:
        group.arrival_order = self._arrivals
        self._arrivals += 1
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def _key(self, group: SequenceGroup) -> tuple[int, int]:
        priority = group.priority if self.config.policy == "priority" else 0
        return priority, group.arrival_order

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            self._preempt_for_priority(out)
        grew_out = self._schedule_running(out)
        num_seqs = sum(len(g.unfinished_seqs()) for g in self.running)
        if not grew_out:  # no room to spare this step otherwise
            num_seqs = self._schedule_swapped(out, num_seqs)
            if not self.swapped:
                self._schedule_waiting(out, num_seqs)
        self.num_preemptions += out.preempted
        self.num_swapped_out += out.swapped_out
        self.num_swapped_in += out.swapped_in
        out.num_batched_tokens = self.config.max_num_batched_tokens - self._budget
        out.running_queue_size = len(self.running)
        out.waiting_queue_size = len(self.waiting)
        out.swapped_queue_size = len(self.swapped)
        return out

    # -- the three queues ---------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput) -> bool:
        """Schedule running groups; returns whether any had to be preempted for lack of blocks."""
        bm = self.block_manager
        order = sorted(self.running, key=self._key)
        decoding = [all(is_decode(s, s.num_uncomputed_tokens) for s in g.unfinished_seqs())
                    for g in order]
        pending = deque([g for g, d in zip(order, decoding) if d]
                        + [g for g, d in zip(order, decoding) if not d])
        preempted: set[int] = set()
        while pending:
            group = pending.popleft()
            seqs, tokens = self._plan(group, group.unfinished_seqs())
            if not seqs:
                continue  # no token budget left this step; it keeps its place
            blocks = sum(bm.blocks_needed(s, n) for s, n in zip(seqs, tokens))
            while not bm.can_allocate(blocks):
                victim = max([*pending, group], key=self._key)
                if victim is not group:
                    pending.remove(victim)
                self._preempt(victim, out)
                preempted.add(id(victim))
                if victim is group:
                    break
            else:
                self._run(group, seqs, tokens, out)
        self.running = [g for g in order if id(g) not in preempted]
        return bool(preempted)

    def _schedule_swapped(self, out: SchedulerOutput, num_seqs: int) -> int:
        bm = self.block_manager
        for group in sorted(self.swapped, key=self._key):
            all_seqs = group.unfinished_seqs()
            seqs, tokens = self._plan(group, all_seqs)
            if not seqs or num_seqs + len(all_seqs) > self.config.max_num_seqs:
                break
            # Room for its blocks and the next tokens (with a copy-on-write each, to be safe).
            blocks = bm.num_swap_in_blocks(all_seqs) + sum(
                cdiv(s.num_computed_tokens + n, bm.block_size) - len(s.block_table) + 1
                for s, n in zip(seqs, tokens))
            if not bm.can_allocate(blocks, admission=True):
                break
            self.swapped.remove(group)
            out.blocks_to_swap_in += bm.swap_in(all_seqs)
            out.swapped_in += 1
            for s in all_seqs:
                s.status = SequenceStatus.RUNNING
            self._run(group, seqs, tokens, out)
            self.running.append(group)
            num_seqs += len(all_seqs)
        return num_seqs

    def _schedule_waiting(self, out: SchedulerOutput, num_seqs: int) -> None:
        bm = self.block_manager
        self.waiting.sort(key=self._key)
        while self.waiting:
            group = self.waiting[0]
            all_seqs = group.unfinished_seqs()
            if not self._can_ever_fit(all_seqs):
                # Waiting would be forever (a sequence grew past the whole cache, say):
                # finish it with what it has, as the seeds' ignored_seq_groups.
                self.waiting.pop(0)
                for s in all_seqs:
                    s.status = SequenceStatus.FINISHED_LENGTH
                out.ignored_groups.append(group)
                continue
            if num_seqs + group.max_num_seqs > self.config.max_num_seqs:
                break
            # Prompt logprobs need every prompt position's logits, so nothing can be skipped.
            use_cache = group.sampling_params.prompt_logprobs is None
            prefixes = [bm.find_cached_prefix(s) if use_cache else [] for s in all_seqs]
            remaining = [len(s.token_ids) - len(p) * bm.block_size
                         for s, p in zip(all_seqs, prefixes)]
            seqs, tokens = self._plan(group, all_seqs, remaining)
            if len(seqs) < len(all_seqs) and not self.config.enable_chunked_prefill:
                break
            if not seqs:
                break
            revived = bm.num_revived(list({b for p in prefixes for b in p}))
            cached = {id(s): len(p) for s, p in zip(all_seqs, prefixes)}
            blocks = revived + sum(
                cdiv(cached[id(s)] * bm.block_size + n, bm.block_size) - cached[id(s)]
                for s, n in zip(seqs, tokens))
            if not bm.can_allocate(blocks, admission=True):
                break
            self.waiting.pop(0)
            # Take every cached prefix before allocating, so no allocation evicts one of them.
            for s, p in zip(all_seqs, prefixes):
                bm.use_cached_prefix(s, p)
                s.status = SequenceStatus.RUNNING
            if group.metrics.first_scheduled_time is None:
                group.num_cached_tokens = all_seqs[0].num_computed_tokens
            self._run(group, seqs, tokens, out)
            self.running.append(group)
            out.num_prefill_groups += 1
            num_seqs += group.max_num_seqs

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Make room for the best waiting group by preempting running groups of lower priority."""
        if not self.waiting or not self.running:
            return
        bm = self.block_manager
        best = min(self.waiting, key=self._key)
        need = sum(cdiv(len(s.token_ids), bm.block_size) for s in best.unfinished_seqs())
        while self.running:
            worst = max(self.running, key=self._key)
            if worst.priority <= best.priority:
                return
            seqs_in_use = sum(len(g.unfinished_seqs()) for g in self.running)
            if (bm.can_allocate(need, admission=True)
                    and seqs_in_use + best.max_num_seqs <= self.config.max_num_seqs):
                return
            self.running.remove(worst)
            self._preempt(worst, out)

    # -- helpers ------------------------------------------------------------------------------
    def _plan(self, group: SequenceGroup, seqs: list[Sequence],
              remaining: list[int] | None = None) -> tuple[list[Sequence], list[int]]:
        """The sequences that run this step and their token counts, within the token budget.
        With chunked prefill a prompt takes what budget is left; without, all or nothing."""
        if remaining is None:
            remaining = [s.num_uncomputed_tokens for s in seqs]
        if sum(remaining) <= self._budget:
            return seqs, remaining
        if not self.config.enable_chunked_prefill:
            return [], []
        if group.sampling_params.use_beam_search and len(seqs) > 1:
            # Beams (recomputing after a preemption) must sample in the same step: each holds
            # back its last token until all can finish together.
            remaining = [n - 1 for n in remaining]
        chosen, tokens, left = [], [], self._budget
        for s, n in zip(seqs, remaining):
            n = min(n, left)
            if n:
                chosen.append(s)
                tokens.append(n)
                left -= n
        return chosen, tokens

    def _run(self, group: SequenceGroup, seqs: list[Sequence], tokens: list[int],
             out: SchedulerOutput) -> None:
        bm = self.block_manager
        for s, n in zip(seqs, tokens):
            out.blocks_to_copy += bm.allocate(s, n)
            # Registered now: a prompt admitted later in this step can already share these
            # blocks, since every layer writes the step's K/V before it reads any.
            bm.cache_full_blocks(s, s.num_computed_tokens + n)
        out.scheduled_groups.append(ScheduledGroup(group, seqs, tokens))
        self._budget -= sum(tokens)

    def _can_ever_fit(self, seqs: list[Sequence]) -> bool:
        bm = self.block_manager
        blocks = sum(cdiv(len(s.token_ids), bm.block_size) for s in seqs)
        tokens = sum(len(s.token_ids) for s in seqs)
        return (blocks <= bm.num_blocks - bm.watermark_blocks
                and (self.config.enable_chunked_prefill
                     or tokens <= self.config.max_num_batched_tokens))

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Swap the group's blocks out to the host pool if that is the mode and there is room;
        otherwise drop its KV and queue it to be prefilled again (recompute)."""
        bm = self.block_manager
        seqs = group.unfinished_seqs()
        out.preempted += 1
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seqs):
            out.blocks_to_swap_out += bm.swap_out(seqs)
            out.swapped_out += 1
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for seq in seqs:
            bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.append(group)  # its arrival order puts it back in front

    # -- after the step -----------------------------------------------------------------------
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
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in request_ids]:
                queue.remove(group)
                for seq in group.unfinished_seqs():
                    if seq.status is SequenceStatus.SWAPPED:
                        self.block_manager.free_host(seq)
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    else:
                        self.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
                aborted.append(group)
        return aborted
