"""Scheduler and BlockManager behaviour, driven directly (no model): budgets, order, preemption,
ref counts and copy-on-write."""
from __future__ import annotations

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.block_manager import BlockManager
from pagedlm.core.scheduler import Scheduler
from pagedlm.sampling_params import SamplingParams
from pagedlm.sequence import Sequence, SequenceGroup, SequenceStatus


def no_caching(block_size: int) -> CacheConfig:
    return CacheConfig(block_size=block_size, enable_prefix_caching=False)


def make_group(rid: str, prompt_len: int, seq_id: int, n: int = 1) -> SequenceGroup:
    ids = list(range(1, prompt_len + 1))
    return SequenceGroup(rid, [Sequence(seq_id, list(ids), prompt_len)], SamplingParams(n=n),
                         None, ids)


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, block_size=4, chunked=False,
                   **config):
    # max_model_len: the budget, the most SchedulerConfig allows without chunked prefill.
    sched = Scheduler(SchedulerConfig(budget, max_seqs, budget, enable_chunked_prefill=chunked,
                                      **config), no_caching(block_size), num_blocks,
                      watermark=0.0)
    return sched, sched.block_manager


def run_step(sched: Scheduler):
    """One step without a model: every sequence that reaches its end gets token 7."""
    out = sched.schedule()
    for sg in out.scheduled_groups:
        for seq, k in zip(sg.seqs, sg.num_samples):
            if k:
                seq.token_ids.append(7)
    sched.update_from_output(out)
    return out


def test_token_budget_and_fcfs_admission():
    sched, _ = make_scheduler(budget=64)
    for i in range(3):
        sched.add_seq_group(make_group(f"r{i}", 30, i))
    out = run_step(sched)
    assert [sg.group.request_id for sg in out.scheduled_groups] == ["r0", "r1"]
    assert out.num_batched_tokens == 60 and out.num_prefill_groups == 2
    assert [g.request_id for g in sched.waiting] == ["r2"]
    # Next step: the two decodes go first, then the waiting prompt fits (2 + 30 <= 64).
    out = run_step(sched)
    assert [sg.group.request_id for sg in out.scheduled_groups] == ["r0", "r1", "r2"]
    assert out.num_batched_tokens == 32 and out.num_prefill_groups == 1
    assert [sg.num_new_tokens for sg in out.scheduled_groups] == [[1], [1], [30]]


def test_max_num_seqs_limits_running():
    sched, _ = make_scheduler(budget=1000, max_seqs=2)
    for i in range(4):
        sched.add_seq_group(make_group(f"r{i}", 5, i))
    for _ in range(3):
        out = run_step(sched)
        assert sum(len(sg.seqs) for sg in out.scheduled_groups) <= 2
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    # n=2 reserves two sequence slots at admission.
    sched2, _ = make_scheduler(budget=1000, max_seqs=3)
    sched2.add_seq_group(make_group("a", 5, 0, n=2))
    sched2.add_seq_group(make_group("b", 5, 1, n=2))
    out = run_step(sched2)
    assert [sg.group.request_id for sg in out.scheduled_groups] == ["a"]


def test_preempts_youngest_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens; three 8-token prompts take 2 blocks each, so the first decode
    # step needs a 7th block and the youngest request must give its blocks back.
    sched, bm = make_scheduler(num_blocks=6, budget=100)
    groups = [make_group(f"r{i}", 8, i) for i in range(3)]
    for g in groups:
        sched.add_seq_group(g)
    run_step(sched)
    assert bm.num_free_blocks == 0
    out = run_step(sched)
    assert sched.stats.num_preemptions >= 1
    victim = groups[2]
    assert victim.seqs[0].status is SequenceStatus.WAITING
    assert victim.seqs[0].num_computed_tokens == 0 and victim.seqs[0].block_table == []
    assert sched.waiting[0] is victim  # back at the front of the queue
    # Its generated token is kept and recomputed with the prompt when it returns.
    assert victim.seqs[0].num_uncomputed_tokens == 9
    scheduled = [sg.group.request_id for sg in out.scheduled_groups]
    assert scheduled == ["r0", "r1"]


def test_abort_frees_blocks_everywhere():
    sched, bm = make_scheduler(num_blocks=16, budget=100)
    for i in range(4):
        sched.add_seq_group(make_group(f"r{i}", 8, i))
    run_step(sched)
    sched.add_seq_group(make_group("w", 8, 9))
    aborted = sched.abort({"r1", "w"})
    assert {g.request_id for g in aborted} == {"r1", "w"}
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for g in aborted for s in g.seqs)
    assert bm.num_free_blocks == 16 - 3 * 2


def test_block_manager_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    parent = Sequence(0, list(range(6)), 6)
    assert bm.allocate_slots([parent], [6]) == []
    parent.num_computed_tokens = 6
    assert len(parent.block_table) == 2 and bm.num_free_blocks == 6
    parent.token_ids.append(1)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    # The last block is half full and shared: the first writer copies it.
    free = bm.num_free_blocks
    copies = bm.allocate_slots([child], [1])
    assert bm.num_free_blocks == free - 1
    assert len(copies) == 1 and copies[0][0] == parent.block_table[1]
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] == copies[0][1] != parent.block_table[1]
    # Now the parent owns its last block alone and writes in place.
    assert bm.allocate_slots([parent], [1]) == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in bm.ref_counts)


def test_watermark_holds_back_admissions():
    bm = BlockManager(num_blocks=100, block_size=4, watermark=0.1)
    seqs = [Sequence(i, [1] * 4 * k, 4 * k) for i, k in enumerate((90, 91, 100))]
    assert bm.can_allocate_slots(seqs[:1], [360], admission=True)
    assert not bm.can_allocate_slots(seqs[1:2], [364], admission=True)
    assert bm.can_allocate_slots(seqs[2:], [400])  # running sequences may use the reserve
    assert bm.can_ever_fit([360]) and not bm.can_ever_fit([361])
    # All or nothing: a refused allocation takes no block.
    assert bm.allocate_slots(seqs[1:2], [364], admission=True) is None
    assert bm.num_free_blocks == 100 and not seqs[1].block_table


# -- chunked prefill ---------------------------------------------------------------------------

def test_chunked_prefill_runs_decodes_first_and_splits_the_prompt_over_steps():
    sched, bm = make_scheduler(budget=16, chunked=True)
    sched.add_seq_group(make_group("a", 6, 0))
    run_step(sched)  # a's prompt in one go; it now decodes
    long_group = make_group("long", 40, 1)
    sched.add_seq_group(long_group)
    chunks = []
    while not long_group.seqs[0].num_output_tokens:
        out = run_step(sched)
        ids = [sg.group.request_id for sg in out.scheduled_groups]
        assert ids[0] == "a" and out.scheduled_groups[0].num_new_tokens == [1]  # decode first
        assert out.num_batched_tokens <= 16
        long = out.scheduled_groups[1]
        chunks.append(long.num_new_tokens[0])
        # Mid-prompt chunks sample nothing; the last one samples the first output token.
        assert long.num_samples == [0 if sum(chunks) < 40 else 1]
    assert chunks == [15, 15, 10]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched, _ = make_scheduler(budget=32, chunked=False)
    sched.add_seq_group(make_group("a", 20, 0))
    sched.add_seq_group(make_group("b", 20, 1))
    out = run_step(sched)
    assert [sg.num_new_tokens for sg in out.scheduled_groups] == [[20]]
    chunked, _ = make_scheduler(budget=32, chunked=True)
    chunked.add_seq_group(make_group("a", 20, 0))
    chunked.add_seq_group(make_group("b", 20, 1))
    out = run_step(chunked)
    assert [sg.num_new_tokens for sg in out.scheduled_groups] == [[20], [12]]


# -- prefix caching ----------------------------------------------------------------------------

def make_caching_scheduler(num_blocks=32, budget=256, block_size=4, **config):
    sched = Scheduler(SchedulerConfig(budget, 8, 1024, **config),
                      CacheConfig(block_size=block_size, enable_prefix_caching=True), num_blocks,
                      watermark=0.0)
    return sched, sched.block_manager


def group_with(rid: str, ids: list[int], seq_id: int, **params) -> SequenceGroup:
    return SequenceGroup(rid, [Sequence(seq_id, list(ids), len(ids))], SamplingParams(**params),
                         None, list(ids))


def test_prefix_cache_reuses_the_longest_cached_prefix():
    sched, bm = make_caching_scheduler()
    prefix = list(range(100, 112))  # 3 full blocks of 4
    a = group_with("a", prefix + [1, 2], 0)
    sched.add_seq_group(a)
    run_step(sched)
    b = group_with("b", prefix + [7, 8, 9], 1)
    sched.add_seq_group(b)
    out = run_step(sched)
    sb = next(sg for sg in out.scheduled_groups if sg.group is b)
    assert sb.num_new_tokens == [3]  # only the suffix is computed
    assert b.seqs[0].block_table[:3] == a.seqs[0].block_table[:3]
    assert [bm.ref_counts[x] for x in b.seqs[0].block_table[:3]] == [2, 2, 2]
    assert b.num_cached_tokens == 12
    assert bm.prefix_hits == 12 and bm.prefix_queries == 14 + 15
    # A prompt that is entirely cached still computes its last token (the step needs logits).
    c = group_with("c", prefix, 2)
    sched.add_seq_group(c)
    out = run_step(sched)
    sc = next(sg for sg in out.scheduled_groups if sg.group is c)
    assert sc.num_new_tokens == [4] and c.seqs[0].block_table[:2] == a.seqs[0].block_table[:2]


def test_prefix_is_shared_within_the_same_step():
    # Every layer writes the step's K/V before reading, so a prompt admitted after another in
    # the same step can already use the blocks the first one computes.
    sched, bm = make_caching_scheduler()
    prefix = list(range(100, 116))
    a, b = group_with("a", prefix + [1], 0), group_with("b", prefix + [2], 1)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    out = run_step(sched)
    assert [sg.num_new_tokens for sg in out.scheduled_groups] == [[17], [1]]
    assert a.seqs[0].block_table[:4] == b.seqs[0].block_table[:4]


def test_prompt_logprobs_requests_skip_the_cache_but_still_fill_it():
    sched, bm = make_caching_scheduler()
    prefix = list(range(100, 112))
    sched.add_seq_group(group_with("a", prefix + [1], 0))
    run_step(sched)
    b = group_with("b", prefix + [2], 1, prompt_logprobs=1)
    sched.add_seq_group(b)
    out = run_step(sched)
    assert next(sg for sg in out.scheduled_groups if sg.group is b).num_new_tokens == [13]


def test_cached_blocks_are_evicted_least_recently_freed_first():
    from pagedlm.core.block_pool import BlockPool
    pool = BlockPool(4, enable_caching=True)
    blocks = [pool.take() for _ in range(4)]
    for i, b in enumerate(blocks[:3]):
        pool.register(b, hash(("h", i)), ("content", i))
    for b in [blocks[1], blocks[0], blocks[2], blocks[3]]:
        pool.release(b)
    assert pool.num_free_blocks == 4
    # The uncached block goes first; then cached ones in the order they were freed.
    assert pool.take() == blocks[3] and pool.num_evictions == 0
    assert pool.take() == blocks[1] and pool.lookup(hash(("h", 1)), ("content", 1)) is None
    # A hit revives a free cached block: it leaves the free list and is not evicted.
    assert pool.lookup(hash(("h", 2)), ("content", 2)) == blocks[2]
    assert pool.lookup(hash(("h", 2)), ("content", 0)) is None  # same hash, other content
    pool.share(blocks[2])
    assert pool.take() == blocks[0] and pool.num_free_blocks == 0
    assert pool.num_evictions == 2 and pool.lookup(hash(("h", 2)), ("content", 2)) == blocks[2]


# -- swapping ----------------------------------------------------------------------------------

def test_swap_preemption_moves_blocks_to_host_and_back_before_new_admissions():
    sched = Scheduler(SchedulerConfig(100, 8, 1024, preemption_mode="swap"), no_caching(4), 6,
                      num_cpu_blocks=8, watermark=0.0)
    bm = sched.block_manager
    groups = [make_group(f"r{i}", 8, i) for i in range(3)]
    for g in groups:
        sched.add_seq_group(g)
    run_step(sched)
    victim = groups[2]
    device_blocks = list(victim.seqs[0].block_table)
    out = run_step(sched)
    assert sched.stats.num_preemptions == sched.stats.num_swapped_out == 1
    assert sched.swapped == [victim]
    assert [p[0] for p in out.blocks_to_swap_out] == device_blocks
    swapped_out = out.blocks_to_swap_out
    assert victim.seqs[0].status is SequenceStatus.SWAPPED
    assert victim.seqs[0].num_computed_tokens == 8  # its KV is kept, not recomputed
    assert bm.cpu.num_free_blocks == 6
    # While r2 is out and no block is free, it stays swapped and nothing else is admitted.
    sched.add_seq_group(make_group("new", 4, 9))
    out = run_step(sched)
    assert sched.stats.num_swapped_in == 0 and sched.swapped == [victim]
    assert [sg.group.request_id for sg in out.scheduled_groups] == ["r0", "r1"]
    # r1 leaves 3 blocks free: exactly r2's 2 blocks plus one for its next token. Swapped
    # groups come back before new prompts, so "new" (1 block) keeps waiting.
    sched.abort({"r1"})
    out = run_step(sched)
    assert sched.stats.num_swapped_in == 1 and sched.swapped == []
    assert [sg.group.request_id for sg in out.scheduled_groups] == ["r0", "r2"]
    assert sorted(p[0] for p in out.blocks_to_swap_in) == sorted(p[1] for p in swapped_out)
    assert out.scheduled_groups[1].num_new_tokens == [1]  # straight back to decoding
    assert [g.request_id for g in sched.waiting] == ["new"] and bm.num_free_blocks == 0
    assert bm.cpu.num_free_blocks == 8


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    sched = Scheduler(SchedulerConfig(100, 8, 1024, preemption_mode="swap"), no_caching(4), 6,
                      num_cpu_blocks=1, watermark=0.0)
    for i in range(3):
        sched.add_seq_group(make_group(f"r{i}", 8, i))
    run_step(sched)
    run_step(sched)
    assert sched.stats.num_preemptions == 1 and sched.stats.num_swapped_out == 0
    assert not sched.swapped
    assert sched.waiting[0].request_id == "r2"


def test_forked_sequences_swap_their_shared_blocks_once():
    bm = BlockManager(16, 4, watermark=0.0, num_cpu_blocks=16)
    parent = Sequence(0, list(range(10)), 10)
    bm.allocate_slots([parent], [10])
    parent.num_computed_tokens = 10
    child = parent.fork(1)
    bm.fork(parent, child)
    pairs = bm.swap_out([parent, child])
    assert len(pairs) == 3 and bm.num_free_blocks == 16
    assert parent.block_table == child.block_table
    assert [bm.cpu.ref_counts[b] for b in parent.block_table] == [2, 2, 2]
    back, copies = bm.swap_in([parent, child], [], [])
    assert len(back) == 3 and copies == [] and bm.cpu.num_free_blocks == 16
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2, 2]


# -- priorities --------------------------------------------------------------------------------

def test_priority_policy_admits_by_priority_and_preempts_lower_priority_running():
    sched, bm = make_scheduler(budget=100, max_seqs=2, policy="priority")
    low = [make_group(f"low{i}", 5, i) for i in range(3)]
    for g in low:
        g.priority = 5
        sched.add_seq_group(g)
    run_step(sched)
    assert [g.request_id for g in sched.running] == ["low0", "low1"]
    high = make_group("high", 5, 9)
    high.priority = 0
    sched.add_seq_group(high)
    out = run_step(sched)
    assert sched.stats.num_preemptions == 1 and low[1].seqs[0].status is SequenceStatus.WAITING
    assert [sg.group.request_id for sg in out.scheduled_groups] == ["low0", "high"]
    # The preempted group waits ahead of the later low-priority one.
    assert [g.request_id for g in sched.waiting] == ["low1", "low2"]
