"""Scheduler and BlockManager behaviour, driven directly (no model): budgets, order, preemption,
ref counts and copy-on-write."""
from __future__ import annotations

from pagedlm.config import SchedulerConfig
from pagedlm.core.block_manager import BlockManager
from pagedlm.core.scheduler import Scheduler
from pagedlm.sampling_params import SamplingParams
from pagedlm.sequence import Sequence, SequenceGroup, SequenceStatus


def make_group(rid: str, prompt_len: int, seq_id: int, n: int = 1) -> SequenceGroup:
    ids = list(range(1, prompt_len + 1))
    return SequenceGroup(rid, [Sequence(seq_id, list(ids), prompt_len)], SamplingParams(n=n),
                         None, ids)


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, block_size=4, chunked=False,
                   **config):
    bm = BlockManager(num_blocks, block_size, watermark=0.0)
    return Scheduler(SchedulerConfig(budget, max_seqs, 1024, enable_chunked_prefill=chunked,
                                     **config), bm), bm


def run_step(sched: Scheduler):
    """One step without a model: every sequence that reaches its end gets token 7."""
    out = sched.schedule()
    sched.update_from_output(out)
    for sg in out.scheduled_groups:
        for seq, k in zip(sg.seqs, sg.num_samples):
            if k:
                seq.token_ids.append(7)
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
    assert out.preempted >= 1 and sched.num_preemptions == out.preempted
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
    assert bm.allocate(parent, 6) == []
    parent.num_computed_tokens = 6
    assert len(parent.block_table) == 2 and bm.num_free_blocks == 6
    parent.token_ids.append(1)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    # The last block is half full and shared: the first writer copies it.
    assert bm.blocks_needed(child, 1) == 1
    copies = bm.allocate(child, 1)
    assert len(copies) == 1 and copies[0][0] == parent.block_table[1]
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] == copies[0][1] != parent.block_table[1]
    # Now the parent owns its last block alone and writes in place.
    assert bm.allocate(parent, 1) == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in bm.ref_counts)


def test_watermark_holds_back_admissions():
    bm = BlockManager(num_blocks=100, block_size=4, watermark=0.1)
    assert bm.can_allocate(90, admission=True)
    assert not bm.can_allocate(91, admission=True)
    assert bm.can_allocate(100)  # running sequences may use the reserve
