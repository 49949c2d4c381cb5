"""What crosses from the engine to the workers each step: ids and diffs, not live objects.

A request's sampling settings and prompt go to the workers once (NewRequestData); a sequence
goes once in full (NewSequenceData: a new prompt, a fork, or one whose block table was rewritten
by a copy-on-write or a swap); afterwards a step carries only what changed: the tokens appended
since the workers last saw it, the blocks appended to its table, and its computed-token count
(CachedSequenceData). The workers keep the rest (worker/model_runner.py: tokens, block tables,
the request's seeded generator), so a decode step costs a few integers per sequence however long
the sequences are, and crossing a process boundary pickles no detokenizer or metrics.

This mirrors vLLM v1's NewRequestData / CachedRequestData, with sequences as the unit since a
request's n > 1 sequences fork from one prefilled prompt here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.core.scheduler import SchedulerOutput
from pagedlm.lora.request import LoRARequest
from pagedlm.sampling_params import SamplingParams
from pagedlm.sequence import Sequence, SequenceGroup
from pagedlm.structured_output.bitmask import GrammarBitmask


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Workers load the adapter themselves from its path (each TP rank its own slices).
    lora_request: LoRARequest | None = None


@dataclass
class NewSequenceData:
    seq_id: int
    req_id: str
    token_ids: list[int]  # prompt and output so far
    block_ids: list[int]


@dataclass
class CachedSequenceData:
    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since last sent
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to its table


@dataclass
class ExecuteModelRequest:
    new_requests: list[NewRequestData] = field(default_factory=list)
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: CachedSequenceData = field(default_factory=CachedSequenceData)
    # The step, one entry per scheduled sequence, in scheduling order (aligned lists).
    seq_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)  # 0 mid-prompt, best_of at a fork
    # Requests whose scheduled prompt chunk should also return prompt logprobs.
    prompt_logprobs_req_ids: list[str] = field(default_factory=list)
    # State the workers can drop (finished or aborted since the last step).
    finished_req_ids: list[str] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on device
    # Structured outputs: the allowed tokens of the samples that have a grammar (None: none do).
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.seq_ids)


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

    def build(self, sched_out: SchedulerOutput) -> ExecuteModelRequest:
        req = ExecuteModelRequest(
            blocks_to_swap_in=sched_out.blocks_to_swap_in,
            blocks_to_swap_out=sched_out.blocks_to_swap_out,
            blocks_to_copy=sched_out.blocks_to_copy,
            finished_req_ids=self._finished_req_ids, finished_seq_ids=self._finished_seq_ids)
        self._finished_req_ids, self._finished_seq_ids = [], []
        cached = req.cached_seqs
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
            for seq, n, k in zip(sg.seqs, sg.num_new_tokens, sg.num_samples):
                synced = seq.synced_block_ids
                table = seq.block_table
                if synced is None or table[:len(synced)] != synced:
                    req.new_seqs.append(NewSequenceData(seq.seq_id, rid, list(seq.token_ids),
                                                        list(table)))
                else:
                    cached.seq_ids.append(seq.seq_id)
                    cached.new_token_ids.append(seq.token_ids[seq.synced_num_tokens:])
                    cached.new_block_ids.append(table[len(synced):])
                seq.synced_num_tokens = len(seq.token_ids)
                seq.synced_block_ids = list(table)
                req.seq_ids.append(seq.seq_id)
                req.num_computed_tokens.append(seq.num_computed_tokens)
                req.num_scheduled_tokens.append(n)
                req.num_samples.append(k)
        return req
