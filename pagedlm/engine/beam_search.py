"""Beam search over a SequenceGroup, built on the same forking as n > 1 sampling.

Each step every live beam contributes its top 2 * beam_width next tokens; the best candidates by
cumulative logprob become the new beams. A beam chosen more than once is forked (the children
share its KV blocks; the scheduler copies the last block on write), a beam not chosen is freed.
Candidates that end (EOS, a stop token, the length limit) become finished hypotheses, scored as
transformers does: cumulative logprob / generated_length ** length_penalty, and the search ends
by transformers' rules for early_stopping, so results match its beam search.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedlm.core.scheduler import ScheduledGroup
from pagedlm.model_executor.layers.sampler import SamplerOutput
from pagedlm.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from pagedlm.engine.output_processor import OutputProcessor


class BeamSearch:

    def __init__(self, processor: OutputProcessor) -> None:
        self.processor = processor

    def step(self, group: SequenceGroup, sg: ScheduledGroup, s: SamplerOutput, row: int) -> int:
        """Advance the group's beams with this step's rows (from `row`); returns the next row."""
        sp = group.sampling_params
        width = sp.best_of
        candidates = []  # (cumulative logprob, parent, token id, logprob)
        for seq, k in zip(sg.seqs, sg.num_samples):
            if k == 0:
                continue  # mid-prompt
            for tid, lp in zip(s.top_token_ids[row][:2 * width], s.top_logprobs[row][:2 * width]):
                candidates.append((seq.cumulative_logprob + lp, seq, tid, lp))
            row += 1
        if not candidates:
            return row
        candidates.sort(key=lambda c: c[0], reverse=True)

        continuations: dict[int, list[tuple[int, float]]] = {}
        num_live = 0
        for rank, (score, parent, tid, lp) in enumerate(candidates[:2 * width]):
            status = self._ends(group, parent, tid)
            if status is not None:
                # Only the top beam_width candidates may finish, as in transformers.
                if rank < width:
                    self._add_finished(group, parent, tid, score, status)
            elif num_live < width:
                continuations.setdefault(id(parent), []).append((tid, lp))
                num_live += 1
                if num_live == 1:
                    best_running = score

        for parent in group.unfinished_seqs():
            conts = continuations.get(id(parent))
            if not conts:
                self._drop(group, parent)
                continue
            for tid, lp in conts[1:]:  # fork before the parent moves on
                self._append(self.processor.fork(group, parent), tid, lp)
            self._append(parent, *conts[0])

        if num_live == 0 or self._done(group, best_running):
            self._finish(group)
        return row

    def _ends(self, group: SequenceGroup, parent: Sequence, tid: int) -> SequenceStatus | None:
        sp = group.sampling_params
        if not sp.ignore_eos and tid in self.processor.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if tid in sp.all_stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if (parent.num_output_tokens + 1 >= sp.max_tokens
                or len(parent.token_ids) + 1 >= self.processor.max_model_len):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _add_finished(self, group: SequenceGroup, parent: Sequence, tid: int, score: float,
                      status: SequenceStatus) -> None:
        sp = group.sampling_params
        if sp.early_stopping is True and len(group.beam_finished) == sp.best_of:
            return
        hyp = parent.fork(next(self.processor.next_seq_id))  # tokens only: no KV blocks
        hyp.token_ids.append(tid)
        hyp.cumulative_logprob = score
        hyp.status = status
        if status is SequenceStatus.FINISHED_STOPPED and tid not in self.processor.eos_token_ids:
            hyp.stop_reason = tid
        normalized = score / (hyp.num_output_tokens ** sp.length_penalty)
        group.beam_finished.append((normalized, hyp))
        group.beam_finished.sort(key=lambda h: h[0], reverse=True)
        del group.beam_finished[sp.best_of:]

    def _done(self, group: SequenceGroup, best_running: float) -> bool:
        """transformers' stopping rule, checked after the step."""
        sp = group.sampling_params
        if len(group.beam_finished) < sp.best_of:
            return False
        if sp.early_stopping is True:
            return True
        gen_len = next(iter(group.unfinished_seqs())).num_output_tokens
        if sp.early_stopping == "never" and sp.length_penalty > 0:
            gen_len = sp.max_tokens
        worst_finished = group.beam_finished[-1][0]
        return best_running / (gen_len ** sp.length_penalty) <= worst_finished

    @staticmethod
    def _append(seq: Sequence, tid: int, lp: float) -> None:
        seq.token_ids.append(tid)
        seq.cumulative_logprob += lp

    def _drop(self, group: SequenceGroup, seq: Sequence) -> None:
        self.processor.scheduler.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
        group.seqs.remove(seq)

    def _finish(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            self._drop(group, seq)
        tokenizer = self.processor.tokenizer
        sp = group.sampling_params
        group.seqs = [hyp for _, hyp in group.beam_finished[:sp.n]]
        for hyp in group.seqs:
            hyp.output_text = tokenizer.decode(hyp.output_token_ids,
                                               skip_special_tokens=sp.skip_special_tokens)
        group.beam_done = True
