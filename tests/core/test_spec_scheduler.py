"""Speculative decoding in the scheduler, driven directly (no model): lookahead slots inside the
token budget, blocks for them, hashes over committed tokens only, slots of rejected drafts
given back, the per-request policy (grammar, max_tokens, back-off) and the batch rule."""
from __future__ import annotations

from types import SimpleNamespace

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.scheduler import Scheduler
from pagedlm.core.scheduler_output import SchedulerOutput
from pagedlm.sampling_params import SamplingParams
from pagedlm.sequence import Sequence, SequenceGroup, SequenceUpdates
from pagedlm.speculative_config import SpeculativeConfig


def make_group(rid: str, prompt_len: int, seq_id: int, max_tokens: int = 100) -> SequenceGroup:
    ids = list(range(1, prompt_len + 1))
    return SequenceGroup(rid, [Sequence(seq_id, list(ids), prompt_len)],
                         SamplingParams(max_tokens=max_tokens), None, ids)


def make_scheduler(k=4, num_blocks=64, budget=64, block_size=4, caching=False,
                   deterministic=False, max_model_len=None, **spec):
    spec_config = SpeculativeConfig(num_speculative_tokens=k, **spec)
    return Scheduler(SchedulerConfig(budget, 8, max_model_len or budget,
                                     enable_chunked_prefill=True),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                     num_blocks, watermark=0.0, speculative_config=spec_config,
                     deterministic=deterministic)


def step(sched: Scheduler, emitted: dict[int, list[int]] | None = None, drafts: int = 0):
    """One step without a model. A sequence given lookahead emits `emitted[seq_id]` (its
    accepted drafts and one more; `drafts` of them were verified); others get token 7."""
    out = sched.schedule()
    updates = SequenceUpdates()
    for sg in out.scheduled_groups:
        for seq, k, la in zip(sg.seqs, sg.num_samples, sg.num_lookahead):
            if not k:
                continue
            tokens = (emitted or {}).get(seq.seq_id, [7]) if la else [7]
            seq.token_ids += tokens
            if la and drafts:
                updates.spec.append((seq, drafts, len(tokens) - 1))
    sched.update_from_output(out, updates)
    return out


def test_lookahead_slots_are_charged_allocated_and_given_back():
    sched = make_scheduler(k=4, block_size=4)
    bm = sched.block_manager
    sched.add_seq_group(make_group("r", 6, 0))
    out = step(sched)  # the prompt: no lookahead while prefilling
    assert out.scheduled_groups[0].num_lookahead == [0]
    seq = sched.running[0].seqs[0]
    assert len(seq.token_ids) == 7 and seq.num_computed_tokens == 6
    free = bm.num_free_blocks
    # A decode with k = 4: 1 + 4 tokens charged; positions 6..10 need blocks 0..2.
    out = sched.schedule()
    sg = out.scheduled_groups[0]
    assert sg.num_new_tokens == [1] and sg.num_lookahead == [4]
    assert out.num_batched_tokens == 5
    assert len(seq.block_table) == 3 and bm.num_free_blocks == free - 1
    # Two of four drafts accepted: 3 tokens emitted, L + e - 1 = 7 + 2 computed; the block past
    # what 10 tokens need (cdiv(10, 4) = 3) stays, nothing more was allocated.
    seq.token_ids += [11, 12, 13]
    sched.update_from_output(out, SequenceUpdates(spec=[(seq, 4, 2)]))
    assert seq.num_computed_tokens == 9 and len(seq.token_ids) == 10
    assert len(seq.block_table) == 3
    stats = sched.stats
    assert (stats.spec_num_drafts, stats.spec_num_accepted, stats.spec_num_verifies) == (4, 2, 1)
    # Next: k = 4 again reaches position 13 (block 3); all rejected -> the block goes back.
    out = sched.schedule()
    assert out.scheduled_groups[0].num_lookahead == [4] and len(seq.block_table) == 4
    seq.token_ids.append(21)
    sched.update_from_output(out, SequenceUpdates(spec=[(seq, 4, 0)]))
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3
    assert bm.num_free_blocks == free - 1
    # Back-off: nothing accepted halved its k.
    assert step(sched).scheduled_groups[0].num_lookahead == [2]


def test_blocks_are_hashed_over_committed_tokens_only():
    sched = make_scheduler(k=4, block_size=4, caching=True)
    bm = sched.block_manager
    sched.add_seq_group(make_group("r", 7, 0))
    step(sched)  # 7 prompt tokens computed, token 7 appended: 8 tokens
    seq = sched.running[0].seqs[0]
    # The decode's lookahead reaches positions 7..11 (blocks 1 and 2). Only block 0 and block
    # 1 (tokens 4..7, all committed) may be hashed: block 2 would hold only drafts.
    out = sched.schedule()
    assert out.scheduled_groups[0].num_lookahead == [4] and len(seq.block_table) == 3
    assert len(seq.block_hashes) == 2 and seq.num_cached_blocks == 2
    seq.token_ids += [30]  # every draft rejected: one token emitted
    sched.update_from_output(out, SequenceUpdates(spec=[(seq, 4, 0)]))
    assert len(seq.block_table) == 3 and len(seq.block_hashes) == 2
    # A later sequence with the same committed tokens finds exactly the hashed blocks.
    twin = Sequence(9, list(seq.token_ids), len(seq.token_ids))
    assert bm.find_cached_prefix(twin) == seq.block_table[:2]


def test_policy_grammar_max_tokens_and_model_length():
    sched = make_scheduler(k=4)
    sched.add_seq_group(make_group("short", 6, 0, max_tokens=3))
    grammar = make_group("grammar", 6, 1)
    # Any (compiled) grammar: its requests never speculate.
    grammar.structured_output = SimpleNamespace(ready=True)
    sched.add_seq_group(grammar)
    step(sched)
    out = step(sched)
    by_id = {sg.group.request_id: sg.num_lookahead[0] for sg in out.scheduled_groups}
    # "short" has 1 output token and may emit 2 more: 1 + 1 lookahead at most.
    assert by_id == {"short": 1, "grammar": 0}
    # Near max_model_len (64 here): no slot past the last position.
    sched = make_scheduler(k=4, budget=64)
    sched.add_seq_group(make_group("long", 61, 0))
    step(sched)
    out = sched.schedule()
    assert out.scheduled_groups[0].num_lookahead == [2]  # positions 61..63


def test_backoff_retries_after_its_own_steps():
    sched = make_scheduler(k=2, backoff_retry_steps=3)
    sched.add_seq_group(make_group("r", 6, 0))
    step(sched)
    ks = []
    for _ in range(9):
        out = step(sched, drafts=1)  # one draft verified, none accepted, each time
        ks.append(out.scheduled_groups[0].num_lookahead[0])
    # 2 -> 1 -> 0: plain for its next 3 tokens, then k = 1 again (and backs off again).
    assert ks == [2, 1, 0, 0, 0, 1, 0, 0, 0]
    # Full acceptance raises k back by one per step, up to num_speculative_tokens.
    seq = sched.running[0].seqs[0]
    seq.spec_k = 1
    assert step(sched, {0: [5, 6]}, drafts=1).scheduled_groups[0].num_lookahead == [1]
    assert step(sched, {0: [5, 6, 7]}, drafts=2).scheduled_groups[0].num_lookahead == [2]
    assert step(sched).scheduled_groups[0].num_lookahead == [2]


def test_backoff_retry_comes_at_the_same_token_through_a_preemption():
    """The back-off counts the sequence's tokens, not its decode steps: a recompute
    preemption's prefill emits one plainly, so counting steps put the retry (and the seeded
    generator's draws after it) a token later than in a run without the preemption."""
    def retry_at(preempt: bool) -> int:
        sched = make_scheduler(k=1, backoff_retry_steps=4)
        sched.add_seq_group(make_group("r", 6, 0))
        step(sched)
        assert step(sched, drafts=1).scheduled_groups[0].num_lookahead == [1]  # backs off
        step(sched)
        seq = sched.running[0].seqs[0]
        if preempt:
            sched._preempt(sched.running.pop(), SchedulerOutput())
            assert seq.num_computed_tokens == 0
        while not step(sched).scheduled_groups[0].num_lookahead[0]:
            assert seq.num_output_tokens < 20
        return seq.num_output_tokens - 1  # its tokens before that step

    assert retry_at(False) == retry_at(True) == 2 + 4


def test_deterministic_resume_holds_the_last_token_for_the_decode():
    """Under --deterministic a speculating sequence back from a recompute preemption prefills
    all but its last token and samples nothing; its next step decodes the last one with its
    k, as the step the preemption replaced would have. With prefix caching, a cached prefix
    covering every token but the last gives back a block so that a token is left to compute.
    Without --deterministic the prefill samples as before."""
    for deterministic, caching in ((True, False), (True, True), (False, False)):
        sched = make_scheduler(k=2, block_size=4, caching=caching,
                               deterministic=deterministic)
        sched.add_seq_group(make_group("r", 4, 0))
        step(sched)
        step(sched, {0: [5, 6, 7]}, drafts=2)
        step(sched)
        seq = sched.running[0].seqs[0]
        assert (len(seq.token_ids), seq.num_computed_tokens) == (9, 8)
        sched._preempt(sched.running.pop(), SchedulerOutput())
        cached = sched.block_manager.find_cached_prefix(seq)
        assert len(cached) == 2 * caching  # its first 8 tokens, all but the last
        sg = step(sched).scheduled_groups[0]
        if not deterministic:
            assert (sg.num_new_tokens, sg.num_samples) == ([9], [1])
            continue
        # Positions 0-7 (4-7 with caching: block 1 given back), none sampled.
        assert (sg.num_new_tokens, sg.num_samples) == ([8 - 4 * caching], [0])
        assert (len(seq.token_ids), seq.num_computed_tokens) == (9, 8)
        sg = step(sched, {0: [8, 9, 10]}, drafts=2).scheduled_groups[0]
        assert (sg.num_new_tokens, sg.num_lookahead, sg.num_samples) == ([1], [2], [1])
        assert len(seq.token_ids) == 12


def test_deterministic_resume_waits_for_room_for_its_decode():
    """The held-back group is admitted only with room for its prefill and the decode after it
    (1 + k slots): admitted with room for the prefill alone, that decode preempted it again."""
    sched = make_scheduler(k=2, block_size=4, num_blocks=8, deterministic=True)
    bm = sched.block_manager
    sched.add_seq_group(make_group("r", 4, 0))
    step(sched)
    step(sched, {0: [5, 6, 7]}, drafts=2)
    step(sched)
    seq = sched.running[0].seqs[0]
    sched._preempt(sched.running.pop(), SchedulerOutput())
    other = Sequence(99, list(range(24)), 24)
    assert bm.allocate_slots([other], [24]) is not None  # 6 of the 8 blocks
    # Its 8 tokens fit the 2 free blocks, but the decode of the 9th with k = 2 needs a third.
    assert not sched.schedule().scheduled_groups and sched.waiting
    bm.free(other)
    sg = step(sched).scheduled_groups[0]
    assert (sg.num_new_tokens, sg.num_samples) == ([8], [0])
    sg = step(sched, {0: [8, 9, 10]}, drafts=2).scheduled_groups[0]
    assert (sg.num_new_tokens, sg.num_lookahead) == ([1], [2])
    assert sched.stats.num_preemptions == 1 and len(seq.token_ids) == 12


def test_a_prompts_last_token_alone_in_a_step_does_not_speculate():
    """Chunks of 8 leave a 9-token prompt's last token alone in the second step: a decode by
    shape, but its token is the first sampled, drawn plainly as a whole prefill draws it (with
    k lookahead slots it was drawn by rejection sampling: a seeded request's first token
    followed the chunking)."""
    sched = make_scheduler(k=2, budget=8, max_model_len=64)
    sched.add_seq_group(make_group("r", 9, 0))
    sg = step(sched).scheduled_groups[0]
    assert (sg.num_new_tokens, sg.num_samples) == ([8], [0])
    sg = step(sched).scheduled_groups[0]
    assert (sg.num_new_tokens, sg.num_samples, sg.num_lookahead) == ([1], [1], [0])
    assert step(sched).scheduled_groups[0].num_lookahead == [2]


def test_batch_rule_is_off_under_deterministic():
    for deterministic, want in ((False, [0, 0, 0]), (True, [2, 2, 2])):
        sched = make_scheduler(k=2, max_batch_for_spec=2, deterministic=deterministic)
        for i in range(3):
            sched.add_seq_group(make_group(f"r{i}", 5, i))
        step(sched)
        out = sched.schedule()
        assert [sg.num_lookahead[0] for sg in out.scheduled_groups] == want
    # Two decoding sequences are within the rule.
    sched = make_scheduler(k=2, max_batch_for_spec=2)
    for i in range(2):
        sched.add_seq_group(make_group(f"r{i}", 5, i))
    step(sched)
    assert [sg.num_lookahead[0] for sg in sched.schedule().scheduled_groups] == [2, 2]


def test_budget_and_block_shortage_fall_back_to_plain_decoding():
    # A budget of 8: the first decode takes 1 + 4, the second has 1 left: plain decode.
    sched = make_scheduler(k=4, budget=8)
    for i in range(2):
        sched.add_seq_group(make_group(f"r{i}", 3, i))
    step(sched)
    out = sched.schedule()
    assert [sg.num_lookahead[0] for sg in out.scheduled_groups] == [4, 0]
    assert out.num_batched_tokens == 6
    # Blocks: 1 block of 4 holds the 4-token sequence's next token, not 4 more: no preemption
    # (under deterministic too: the group would only preempt itself).
    for deterministic in (False, True):
        sched = make_scheduler(k=4, num_blocks=1, block_size=4, deterministic=deterministic)
        sched.add_seq_group(make_group("r", 3, 0))
        step(sched)
        out = sched.schedule()
        assert out.scheduled_groups[0].num_lookahead == [0]
        assert sched.stats.num_preemptions == 0
    # Deterministic: a group whose 1 + k does not fit what is left of the budget waits for
    # the next step rather than change its k.
    sched = make_scheduler(k=4, budget=8, deterministic=True)
    for i in range(2):
        sched.add_seq_group(make_group(f"r{i}", 3, i))
    step(sched)
    out = step(sched)
    assert [sg.group.request_id for sg in out.scheduled_groups] == ["r0"]
    assert out.scheduled_groups[0].num_lookahead == [4] and len(sched.running) == 2


def test_deterministic_keeps_k_when_short_of_blocks():
    # 3 blocks of 4: r0's decode with k = 4 takes its second block, and r1 (last in fcfs
    # order, so the victim is itself) has no block left for its lookahead. By default it
    # decodes plainly; under deterministic its k is its own, so it is preempted instead, and
    # whenever it decodes later it has its 4 slots.
    for deterministic in (False, True):
        sched = make_scheduler(k=4, num_blocks=3, block_size=4, deterministic=deterministic)
        for i in range(2):
            sched.add_seq_group(make_group(f"r{i}", 3, i))
        step(sched)
        out = step(sched)
        got = {sg.group.request_id: sg.num_lookahead[0] for sg in out.scheduled_groups}
        if not deterministic:
            assert got == {"r0": 4, "r1": 0} and sched.stats.num_preemptions == 0
            continue
        assert got == {"r0": 4} and sched.stats.num_preemptions == 1
        r1_lookahead = []
        for _ in range(6):
            out = step(sched)
            r1_lookahead += [sg.num_lookahead[0] for sg in out.scheduled_groups
                             if sg.group.request_id == "r1"
                             and sg.seqs[0].num_computed_tokens >= 3]
        assert set(r1_lookahead) <= {4}


def test_lookahead_beside_a_chunked_prefill():
    # A decode with k = 4 takes 5 of the 16-token budget; a long prompt's chunk takes the
    # rest, and gets no lookahead until its prompt is done.
    sched = make_scheduler(k=4, budget=16, max_model_len=128)
    sched.add_seq_group(make_group("decode", 4, 0))
    step(sched)
    sched.add_seq_group(make_group("prompt", 40, 1))
    out = step(sched)
    by_id = {sg.group.request_id: (sg.num_new_tokens[0], sg.num_lookahead[0])
             for sg in out.scheduled_groups}
    assert by_id == {"decode": (1, 4), "prompt": (11, 0)} and out.num_batched_tokens == 16
    while sched.waiting or any(s.num_computed_tokens < 40 for g in sched.running
                               for s in g.seqs if s.seq_id == 1):
        step(sched)
    out = step(sched)
    assert [sg.num_lookahead[0] for sg in out.scheduled_groups] == [4, 4]
