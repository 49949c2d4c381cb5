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
   longest cached prefix, while the budgets and the free blocks (less a watermark) allow. A
   group that recompute preempted comes back by the ResumePolicy's rules (resume_policy.py).

LoRA (the seeds' curr_loras): the running groups use at most max_loras distinct adapters, so
every step fits the workers' adapter slots. A waiting group whose adapter finds no slot stays
in its place; behind it only base-model groups are admitted, so no later adapter request takes
the slot it waits for (no starvation) and FCFS order among adapter requests holds.
"""
from __future__ import annotations

import logging
from collections import deque
from operator import attrgetter

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.block_manager import BlockManager, PoolFactory, plain_pool
from pagedlm.core.multi_step import multi_step_lookahead
from pagedlm.core.resume_policy import ResumePolicy
from pagedlm.core.scheduler_output import ScheduledGroup, SchedulerOutput, SchedulerStats
from pagedlm.core.spec_policy import SpecPolicy
from pagedlm.model_io import is_decode
from pagedlm.sequence import Sequence, SequenceGroup, SequenceStatus, SequenceUpdates
from pagedlm.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


_arrival_order = attrgetter("arrival_order")


class Scheduler:

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 num_device_blocks: int, num_cpu_blocks: int = 0, *, watermark: float = 0.01,
                 pool_factory: PoolFactory = plain_pool,
                 speculative_config: SpeculativeConfig | None = None,
                 deterministic: bool = False) -> None:
        """The Scheduler owns its BlockManager, sized by what the executor allocated."""
        self.config = config
        self.deterministic = deterministic
        self.spec_policy = (SpecPolicy(speculative_config, deterministic, config.max_model_len,
                                       config.max_num_batched_tokens)
                            if speculative_config is not None else None)
        self.block_manager = BlockManager(
            num_device_blocks, cache_config.block_size, watermark, num_cpu_blocks,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo, pool_factory=pool_factory)
        self.resume = ResumePolicy(self.block_manager, self.spec_policy, deterministic)
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.stats = SchedulerStats()
        self._arrivals = 0
        self._budget = 0  # tokens left in the step being scheduled

    def add_seq_group(self, group: SequenceGroup) -> None:
        group.arrival_order = self._arrivals
        self._arrivals += 1
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _key(self, group: SequenceGroup) -> tuple[int, int]:
        priority = group.priority if self.config.policy == "priority" else 0
        return priority, group.arrival_order

    def schedule(self) -> SchedulerOutput:
        sched_out = SchedulerOutput()
        self.block_manager.begin_step()
        self._budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            self._preempt_for_priority(sched_out)
        any_preempted, num_seqs = self._schedule_running(sched_out)
        if not any_preempted:  # no room to spare this step otherwise
            num_seqs = self._schedule_swapped(sched_out, num_seqs)
            if not self.swapped:
                self._schedule_waiting(sched_out, num_seqs)
        if sched_out.num_steps > 1 and sched_out.num_prefill_groups:
            self._drop_multi_step(sched_out)
        if self.config.max_loras:
            n = len({sg.group.lora_int_id for sg in sched_out.scheduled_groups} - {0})
            self.stats.max_step_loras = max(self.stats.max_step_loras, n)
        sched_out.num_batched_tokens = self.config.max_num_batched_tokens - self._budget
        sched_out.running_queue_size = len(self.running)
        sched_out.waiting_queue_size = len(self.waiting)
        sched_out.swapped_queue_size = len(self.swapped)
        return sched_out

    # -- the three queues ---------------------------------------------------------------------
    def _schedule_running(self, sched_out: SchedulerOutput) -> tuple[bool, int]:
        """Schedule running groups; returns whether any had to be preempted for lack of blocks,
        and the sequences of the groups still running (best_of for one still on its
        prompt)."""
        bm = self.block_manager
        # Under fcfs every key's priority is 0: the arrival order alone sorts them the same.
        order = sorted(self.running, key=self._key if self.config.policy == "priority"
                       else _arrival_order)
        # Each group's unfinished sequences, once: nothing finishes while a step is scheduled.
        unfinished: dict[int, list[Sequence]] = {}
        decoding: list[SequenceGroup] = []
        prefilling: list[SequenceGroup] = []
        for g in order:
            unfinished[id(g)] = seqs = g.unfinished_seqs()
            for s in seqs:
                if not is_decode(s.num_computed_tokens, len(s.token_ids) - s.num_computed_tokens):
                    prefilling.append(g)
                    break
            else:
                decoding.append(g)
        pending = deque(decoding + prefilling)
        policy = self.spec_policy
        decoding_ids = {id(g) for g in decoding} if policy is not None else set()
        speculate = policy is not None and policy.batch_allows(
            sum(len(unfinished[id(g)]) for g in decoding))
        # Multi-step decoding: only when every running group decodes (a step with a prompt
        # chunk runs the model once; one admitted from the queue gives the slots back).
        steps = self.config.num_scheduler_steps
        multi = steps > 1 and not prefilling
        preempted: set[int] = set()
        while pending:
            group = pending.popleft()
            seqs, tokens = self._plan(group, unfinished[id(group)])
            if not seqs:
                continue  # no token budget left this step; it keeps its place
            lookahead = None
            if multi:
                lookahead = [multi_step_lookahead(group, s, steps, self.config.max_model_len)
                             for s in seqs]
            elif speculate and id(group) in decoding_ids:
                lookahead = [policy.lookahead(group, s) for s in seqs]
                need = sum(tokens) + sum(lookahead)
                if need > self._budget:
                    if policy.deterministic and need <= self.config.max_num_batched_tokens:
                        continue  # its k is its own: it waits for a step with the budget
                    lookahead = None
            while (copies := bm.allocate_slots(
                    seqs, tokens if not lookahead else
                    [n + k for n, k in zip(tokens, lookahead)])) is None:
                victim = max([*pending, group], key=self._key)
                if lookahead and any(lookahead) and (
                        multi or not policy.deterministic
                        or (victim is group and not bm.can_ever_fit_group(seqs,
                            [len(s.token_ids) + k for s, k in zip(seqs, lookahead)]))):
                    # Plain decoding before anyone is preempted (multi-step: always; its
                    # tokens are the same either way). Deterministic: k is the
                    # request's own, so the group is preempted with it (and comes back with
                    # it) rather than decoding plainly because of what else runs; only slots
                    # the whole cache could never hold are given up.
                    lookahead = None
                    continue
                if victim is not group:
                    pending.remove(victim)
                self._preempt(victim, sched_out)
                preempted.add(id(victim))
                if victim is group:
                    break
            else:
                self._add_scheduled(group, seqs, tokens, copies, sched_out, lookahead,
                                    charge_lookahead=not multi)
        if multi:
            sched_out.num_steps = steps
        self.running = [g for g in order if id(g) not in preempted]
        # A group still on its prompt counts the best_of sequences it forks into, as its
        # admission did: counted as one, a second group was admitted beside it, and the two
        # ran more sequences than max_num_seqs (5 of 4, measured), so a step's budget could
        # no longer hold all their decodes and a seeded group's split over two steps.
        return bool(preempted), sum(g.sampling_params.best_of if g.is_fresh
                                    else len(unfinished[id(g)]) for g in self.running)

    def _drop_multi_step(self, sched_out: SchedulerOutput) -> None:
        """A prompt joined the step: it runs once, and the decodes' lookahead slots go back."""
        sched_out.num_steps = 1
        for sg in sched_out.scheduled_groups:
            if any(sg.num_lookahead):
                for seq in sg.seqs:
                    self.block_manager.trim(seq)
                sg.num_lookahead = [0] * len(sg.seqs)

    def _curr_loras(self) -> set[int]:
        return {g.lora_int_id for g in self.running} - {0}

    def _lora_fits(self, group: SequenceGroup, curr_loras: set[int]) -> bool:
        lora = group.lora_int_id
        return not lora or lora in curr_loras or len(curr_loras) < self.config.max_loras

    def _schedule_swapped(self, sched_out: SchedulerOutput, num_seqs: int) -> int:
        bm = self.block_manager
        for group in sorted(self.swapped, key=self._key):
            all_seqs = group.unfinished_seqs()
            seqs, tokens = self._plan(group, all_seqs)
            if not seqs or num_seqs + group.max_num_seqs > self.config.max_num_seqs:
                break
            if self.config.max_loras and not self._lora_fits(group, self._curr_loras()):
                self.stats.num_lora_waits += 1
                break
            lookahead = self._swap_in_lookahead(group, seqs, tokens)
            if lookahead is not None and sum(tokens) + sum(lookahead) > self._budget:
                break  # its k is its own: it waits for a step with the budget
            swapped_in = bm.swap_in(all_seqs, seqs, tokens if lookahead is None else
                                    [n + k for n, k in zip(tokens, lookahead)])
            if swapped_in is None and lookahead is not None:
                break  # short of blocks for its k: it waits, as its decode would (preempted)
            if swapped_in is None:
                if bm.swap_in_blocks(all_seqs, seqs, tokens) > bm.max_admissible_blocks:
                    # Its sequences grew past the whole cache while it ran: waiting would be
                    # forever (the engine stepped on empty, 78,000 steps a minute), so it
                    # finishes with what it has, as a waiting group that cannot fit does.
                    self.swapped.remove(group)
                    for s in all_seqs:
                        bm.free_host(s)
                    self._ignore(group, all_seqs, sched_out)
                    continue
                break
            pairs, copies = swapped_in
            self.swapped.remove(group)
            sched_out.blocks_to_swap_in += pairs
            self.stats.num_swapped_in += 1
            for s in all_seqs:
                s.status = SequenceStatus.RUNNING
            self._add_scheduled(group, seqs, tokens, copies, sched_out, lookahead)
            self.running.append(group)
            num_seqs += group.max_num_seqs
        return num_seqs

    def _swap_in_lookahead(self, group: SequenceGroup, seqs: list[Sequence], tokens: list[int]
                           ) -> list[int] | None:
        """Under --deterministic, a decoding group swapped in speculates in that step as it
        would have without the swap: decoding plainly there drew the seeded generator once
        where the step draws 1 + k times (its tokens then followed the load). None: plainly
        (outside the mode; a group still prefilling; nothing to speculate)."""
        policy = self.spec_policy
        if (policy is None or not policy.deterministic
                or not all(is_decode(s.num_computed_tokens, n) for s, n in zip(seqs, tokens))):
            return None
        lookahead = policy.fitting_lookahead(group, seqs, self.block_manager.can_ever_fit_group)
        return lookahead if any(lookahead) else None

    def _schedule_waiting(self, sched_out: SchedulerOutput, num_seqs: int) -> None:
        bm = self.block_manager
        self.waiting.sort(key=self._key)
        curr_loras = self._curr_loras() if self.config.max_loras else set()
        lora_blocked = False  # a group waits for an adapter slot: hold later adapters back
        i = 0
        while i < len(self.waiting):
            group = self.waiting[i]
            all_seqs = group.unfinished_seqs()
            if group.lora_int_id and (lora_blocked or not self._lora_fits(group, curr_loras)):
                lora_blocked = True
                self.stats.num_lora_waits += 1
                i += 1
                continue
            if group.structured_output is not None and not group.structured_output.ready:
                i += 1  # its grammar is still compiling: the others go ahead (no budget used)
                continue
            if not self._can_ever_fit(all_seqs):
                # Waiting would be forever (a sequence grew past the whole cache, say):
                # finish it with what it has, as the seeds' ignored_seq_groups.
                self.waiting.pop(i)
                self._ignore(group, all_seqs, sched_out)
                continue
            if num_seqs + group.max_num_seqs > self.config.max_num_seqs:
                break
            # Prompt logprobs need every prompt position's logits, so nothing can be skipped.
            use_cache = group.sampling_params.prompt_logprobs is None
            prefixes = {s: bm.find_cached_prefix(s) if use_cache else [] for s in all_seqs}
            lead = self.resume.prompt_leader(all_seqs)
            if lead is not None and len(prefixes[lead[0]]) * bm.block_size < lead[1]:
                # Its first sequence computes the shared prompt alone; room for all of them.
                leader, shared = lead
                run, prefixes = [leader], {leader: prefixes[leader]}
                remaining = [shared - len(prefixes[leader]) * bm.block_size]
                room = self.resume.room_to_share(group, all_seqs, shared)
            else:
                held = {s: self.resume.held_back(s) for s in all_seqs}
                for s in all_seqs:
                    if held[s] and len(s.token_ids) - len(prefixes[s]) * bm.block_size < 2:
                        prefixes[s] = prefixes[s][:-1]  # leave it a token to compute, one held
                run, remaining = all_seqs, [
                    len(s.token_ids) - len(prefixes[s]) * bm.block_size - held[s]
                    for s in all_seqs]
                room = not any(held.values()) or self.resume.room_to_resume(group, all_seqs,
                                                                          remaining, prefixes)
            seqs, tokens = self._plan(group, run, remaining)
            if not seqs or (len(seqs) < len(run) and not self.config.enable_chunked_prefill):
                break
            if not room:
                break
            copies = bm.allocate_slots(seqs, tokens, admission=True, prefixes=prefixes)
            if copies is None:
                break
            self.waiting.pop(i)
            if group.lora_int_id:
                curr_loras.add(group.lora_int_id)
            for s in all_seqs:
                s.status = SequenceStatus.RUNNING
            if group.metrics.first_scheduled_time is None:
                group.num_cached_tokens = all_seqs[0].num_computed_tokens
            self._add_scheduled(group, seqs, tokens, copies, sched_out)
            self.running.append(group)
            sched_out.num_prefill_groups += 1
            num_seqs += group.max_num_seqs

    def _preempt_for_priority(self, sched_out: SchedulerOutput) -> None:
        """Make room for the best waiting group by preempting running groups of lower priority."""
        if not self.waiting or not self.running:
            return
        bm = self.block_manager
        best = min(self.waiting, key=self._key)
        seqs = best.unfinished_seqs()
        tokens = [s.num_uncomputed_tokens for s in seqs]
        while self.running:
            worst = max(self.running, key=self._key)
            if worst.priority <= best.priority:
                return
            seqs_in_use = sum(g.max_num_seqs for g in self.running)
            if (bm.can_allocate_slots(seqs, tokens, admission=True)
                    and seqs_in_use + best.max_num_seqs <= self.config.max_num_seqs):
                return
            self.running.remove(worst)
            self._preempt(worst, sched_out)

    # -- helpers ------------------------------------------------------------------------------
    def _plan(self, group: SequenceGroup, seqs: list[Sequence],
              remaining: list[int] | None = None) -> tuple[list[Sequence], list[int]]:
        """The sequences that run this step and their token counts, within the token budget.
        With chunked prefill a prompt takes what budget is left; without, all or nothing."""
        if remaining is None:
            lead = self.resume.prompt_leader(seqs) if len(seqs) > 1 else None
            if lead is not None:
                seqs, remaining = [lead[0]], [lead[1] - lead[0].num_computed_tokens]
            else:
                remaining = [len(s.token_ids) - s.num_computed_tokens for s in seqs]
                if self.deterministic:  # (the per-step path of every other mode skips this)
                    seqs, remaining = self.resume.hold_back(seqs, remaining)
        if sum(remaining) <= self._budget:
            return seqs, remaining
        if not self.config.enable_chunked_prefill:
            return [], []
        chosen, tokens, left = [], [], self._budget
        for s, n in zip(seqs, remaining):
            n = min(n, left)
            if n:
                chosen.append(s)
                tokens.append(n)
                left -= n
        return chosen, tokens

    def _add_scheduled(self, group: SequenceGroup, seqs: list[Sequence], tokens: list[int],
                       copies: list[tuple[int, int]], sched_out: SchedulerOutput,
                       lookahead: list[int] | None = None, charge_lookahead: bool = True) -> None:
        """Put a group whose slots are allocated into this step's output; speculative
        lookahead slots are charged to the token budget (they are computed as verification
        rows in the step), multi-step ones are not (each iteration computes one token)."""
        sched_out.blocks_to_copy += copies
        sched_out.scheduled_groups.append(ScheduledGroup(group, seqs, tokens,
                                                         num_lookahead=lookahead))
        self._budget -= sum(tokens) + (sum(lookahead) if lookahead and charge_lookahead else 0)

    def _ignore(self, group: SequenceGroup, seqs: list[Sequence],
                sched_out: SchedulerOutput) -> None:
        """Finish a group that can never be scheduled again with what it has. Its outputs'
        finish_reason is 'length', as at max_tokens: the log says which it was."""
        logger.warning("request %s: its %d sequence(s) of up to %d tokens no longer fit in the "
                       "KV cache (%d blocks of %d tokens at most for one request); finished "
                       "with what they have", group.request_id, len(seqs),
                       max(len(s.token_ids) for s in seqs),
                       self.block_manager.max_admissible_blocks, self.block_manager.block_size)
        for s in seqs:
            s.status = SequenceStatus.FINISHED_LENGTH
        sched_out.ignored_groups.append(group)
        self.stats.num_ignored += 1

    def _can_ever_fit(self, seqs: list[Sequence]) -> bool:
        lens = [len(s.token_ids) for s in seqs]
        shared = self.block_manager.shared_prompt_tokens(seqs)
        # A step computes the shared prompt, and a later one the rest of every sequence.
        step = max(shared, sum(lens) - len(lens) * shared)
        return (self.block_manager.can_ever_fit(lens, shared)
                and (self.config.enable_chunked_prefill
                     or step <= self.config.max_num_batched_tokens))

    def _preempt(self, group: SequenceGroup, sched_out: SchedulerOutput) -> None:
        """Swap the group's blocks out to the host pool if that is the mode and there is room;
        otherwise drop its KV and queue it to be prefilled again (recompute)."""
        bm = self.block_manager
        seqs = group.unfinished_seqs()
        self.stats.num_preemptions += 1
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seqs):
            sched_out.blocks_to_swap_out += bm.swap_out(seqs)
            self.stats.num_swapped_out += 1
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
    def update_from_output(self, sched_out: SchedulerOutput,
                           updates: SequenceUpdates | None = None) -> list[SequenceGroup]:
        """Act on a finished step: its tokens are now in the KV cache; the output processor's
        forks share their parent's blocks; finished sequences free theirs. Returns the groups
        that finished (they leave the running queue)."""
        for sg in sched_out.scheduled_groups:
            for seq, n in zip(sg.seqs, sg.num_new_tokens):
                seq.num_computed_tokens += n
            if len(sg.seqs) == 1 and len(sg.group.seqs) > 1:  # (a prompt's first sequence)
                self.resume.join_leader(sg.group)
        if updates is not None:
            for group, parent, child in updates.forks:
                self.block_manager.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                group.seqs.append(child)
            for seq, num_drafts, num_accepted in updates.spec:
                seq.num_computed_tokens += num_accepted  # their K/V were written in the step
                self.stats.spec_num_drafts += num_drafts
                self.stats.spec_num_accepted += num_accepted
                self.stats.spec_num_verifies += 1
                self.spec_policy.update(seq, num_drafts, num_accepted)
            for seq, num_extra in updates.multi_step:
                seq.num_computed_tokens += num_extra  # computed by the step's later iterations
            for seq, status in updates.finished:
                self._finish_seq(seq, status)
        if self.spec_policy is not None or sched_out.num_steps > 1:
            # The slots of rejected (or never proposed) lookahead tokens go back to the pool,
            # and a multi-step step's unused ones (a worker that ran it once).
            for sg in sched_out.scheduled_groups:
                for seq, k in zip(sg.seqs, sg.num_lookahead):
                    if k and not seq.status.finished:
                        self.block_manager.trim(seq)
        finished = [sg.group for sg in sched_out.scheduled_groups if sg.group.is_finished()]
        if finished:
            self.running = [g for g in self.running if not g.is_finished()]
        return finished

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.block_manager.free(seq)

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
                        self._finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
                aborted.append(group)
        return aborted
