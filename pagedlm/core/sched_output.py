"""ExecuteModelRequestBuilder: each SchedulerOutput -> the workers' message (model_io.py).

It remembers what the workers already hold (the requests sent, each sequence's synced tokens and
block table), so a step sends only ids and diffs: a request once, a sequence in full once (or
again after its table was rewritten), and afterwards only what changed.
"""
from __future__ import annotations

from pagedlm.core.scheduler_output import SchedulerOutput
from pagedlm.model_io import ExecuteModelRequest, NewRequestData, NewSequenceData
from pagedlm.sequence import Sequence, SequenceGroup


class ExecuteModelRequestBuilder:
    """Turns each SchedulerOutput into the workers' message, remembering what they have."""

    def __init__(self) -> None:
        self._sent_requests: set[str] = set()
        self._finished_req_ids: list[str] = []
        self._finished_seq_ids: list[int] = []

    def request_finished(self, group: SequenceGroup) -> None:
        """The group is gone (finished or aborted): workers may drop it with the next step."""
        if group.request_id in self._sent_requests:
            self._sent_requests.discard(group.request_id)
            self._finished_req_ids.append(group.request_id)

    def seq_finished(self, seq: Sequence) -> None:
        if seq.synced_block_ids is not None:
            seq.synced_block_ids = None
            self._finished_seq_ids.append(seq.seq_id)

    def not_delivered(self, req: ExecuteModelRequest) -> None:
        """req's step failed (a second Ctrl-C, a failed worker): its drops go again with the
        next step (the workers drop idempotently), or they kept those requests for good."""
        self._finished_req_ids = req.finished_req_ids + self._finished_req_ids
        self._finished_seq_ids = req.finished_seq_ids + self._finished_seq_ids

    def build(self, sched_out: SchedulerOutput) -> ExecuteModelRequest:
        req = ExecuteModelRequest(
            blocks_to_swap_in=sched_out.blocks_to_swap_in,
            blocks_to_swap_out=sched_out.blocks_to_swap_out,
            blocks_to_copy=sched_out.blocks_to_copy,
            finished_req_ids=self._finished_req_ids, finished_seq_ids=self._finished_seq_ids,
            num_steps=sched_out.num_steps)
        self._finished_req_ids, self._finished_seq_ids = [], []
        cached = req.cached_seqs
        speculating = False  # num_lookahead stays empty until a sequence has lookahead
        for sg in sched_out.scheduled_groups:
            group = sg.group
            rid = group.request_id
            if rid not in self._sent_requests:
                self._sent_requests.add(rid)
                req.new_requests.append(NewRequestData(rid, group.prompt_token_ids,
                                                       group.sampling_params,
                                                       group.lora_request))
            sp = group.sampling_params
            if sp.prompt_logprobs is not None and group.prompt_logprobs is None:
                req.prompt_logprobs_req_ids.append(rid)
            if any(sg.num_lookahead) and not speculating:
                speculating = True
                req.num_lookahead = [0] * len(req.seq_ids)
            for seq, n, k, la in zip(sg.seqs, sg.num_new_tokens, sg.num_samples,
                                     sg.num_lookahead):
                synced = seq.synced_block_ids
                table = seq.block_table
                if synced is None:
                    req.new_seqs.append(NewSequenceData(seq.seq_id, rid, list(seq.token_ids),
                                                        list(table)))
                    seq.synced_block_ids = list(table)
                else:
                    # synced is brought up to date in place, not copied: most steps of a
                    # decode leave the table as it was, and then compare it without a slice.
                    keep = len(synced)
                    if (table != synced if len(table) == keep else table[:keep] != synced):
                        # Its tail was rewritten: resend from there.
                        keep = next((i for i, (a, b) in enumerate(zip(table, synced))
                                     if a != b), min(len(table), keep))
                        cached.num_kept_blocks[seq.seq_id] = keep
                        del synced[keep:]
                    tail = table[keep:]
                    synced += tail
                    cached.seq_ids.append(seq.seq_id)
                    cached.new_token_ids.append(seq.token_ids[seq.synced_num_tokens:])
                    cached.new_block_ids.append(tail)
                seq.synced_num_tokens = len(seq.token_ids)
                req.seq_ids.append(seq.seq_id)
                req.num_computed_tokens.append(seq.num_computed_tokens)
                req.num_scheduled_tokens.append(n)
                req.num_samples.append(k)
                if speculating:
                    req.num_lookahead.append(la)
        return req
