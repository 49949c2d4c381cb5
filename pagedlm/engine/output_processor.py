"""Output processing: append sampled tokens, detokenize, check stops, build RequestOutputs."""
from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from pagedlm.core.scheduler import Scheduler, SchedulerOutput
from pagedlm.engine.beam_search import BeamSearch
from pagedlm.engine.detokenizer import IncrementalDetokenizer
from pagedlm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagedlm.sampling_params import RequestOutputKind
from pagedlm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedlm.worker.model_runner import ModelRunnerOutput, PromptLogprobs


class OutputProcessor:

    def __init__(self, scheduler: Scheduler, tokenizer: PreTrainedTokenizerBase,
                 eos_token_ids: frozenset[int], max_model_len: int, next_seq_id) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.next_seq_id = next_seq_id
        self.beam_search = BeamSearch(self)

    def process(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        now = time.time()
        s = result.sampler_output
        row = 0
        for sg in sched.scheduled_groups:
            group = sg.group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            if group.sampling_params.use_beam_search:
                row = self.beam_search.step(group, sg, s, row)
                continue
            for seq, k in zip(list(sg.seqs), sg.num_samples):
                if k == 0:
                    continue  # mid-prompt: nothing sampled yet
                # A prompt sampled k > 1 times forks into k sequences sharing its blocks.
                targets = [seq] + [self.fork(group, seq) for _ in range(k - 1)]
                for target in targets:
                    lp = None
                    if s.sampled_logprobs is not None:
                        lp = (s.sampled_logprobs[row], s.ranks[row],
                              s.top_token_ids[row] if s.top_token_ids else [],
                              s.top_logprobs[row] if s.top_logprobs else [])
                    self._append_token(group, target, s.sampled_token_ids[row], lp)
                    row += 1
            if any(sg.num_samples) and group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
        for p in result.prompt_logprobs:
            self._add_prompt_logprobs(sched.scheduled_groups[p.group_index].group, p)
        self.scheduler.free_finished_groups()

        outputs = []
        for sg in sched.scheduled_groups:
            if not any(sg.num_samples) and not sg.group.is_finished():
                continue  # a prompt chunk: nothing new to report
            out = make_request_output(sg.group)
            if out is not None:
                outputs.append(out)
        return outputs

    def fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = parent.fork(next(self.next_seq_id))
        self.scheduler.fork_seq(parent, child)
        group.seqs.append(child)
        return child

    def _append_token(self, group: SequenceGroup, seq: Sequence, token_id: int, lp) -> None:
        params = group.sampling_params
        seq.token_ids.append(token_id)
        if lp is not None:
            logprob, rank, top_ids, top_vals = lp
            seq.cumulative_logprob += logprob
            if params.logprobs is not None:
                seq.output_logprobs.append(self._position_logprobs(
                    token_id, logprob, rank, top_ids[:params.logprobs],
                    top_vals[:params.logprobs]))
        delta = self.detokenizer.step(seq.detok, token_id, params.skip_special_tokens)
        seq.output_text += delta
        status = self._check_stop(group, seq, token_id, len(delta))
        if status is not None:
            self.scheduler.finish_seq(seq, status)

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token_id: int,
                    new_chars: int) -> SequenceStatus | None:
        params = group.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            eos = not params.ignore_eos and token_id in self.eos_token_ids
            if eos or token_id in params.all_stop_token_ids:
                # As in vLLM, the stopping token's text is left out of the output.
                if new_chars and not params.include_stop_str_in_output:
                    seq.output_text = seq.output_text[:-new_chars]
                if not eos:
                    seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
            if params.stop_strings and new_chars:
                # Only where the new text could complete a stop string: matches that straddle
                # token boundaries are found, and the scan stays short.
                start = max(0, len(seq.output_text) - new_chars - params.max_stop_len + 1)
                for stop in params.stop_strings:
                    idx = seq.output_text.find(stop, start)
                    if idx != -1:
                        end = idx + len(stop) if params.include_stop_str_in_output else idx
                        seq.output_text = seq.output_text[:end]
                        seq.stop_reason = stop
                        return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _position_logprobs(self, token_id: int, logprob: float, rank: int, top_ids: list[int],
                           top_vals: list[float]) -> PositionLogprobs:
        entry = {token_id: Logprob(logprob, rank, self.tokenizer.decode([token_id]))}
        for r, (tid, val) in enumerate(zip(top_ids, top_vals), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, r, self.tokenizer.decode([tid]))
        return entry

    def _add_prompt_logprobs(self, group: SequenceGroup, p: PromptLogprobs) -> None:
        # Accumulate chunk by chunk; the first prompt token has nothing to be scored against.
        acc = group.partial_prompt_logprobs
        if not acc:
            acc.append(None)
        for i, tid in enumerate(p.token_ids):
            top_ids = p.top_token_ids[i] if p.top_token_ids else []
            top_vals = p.top_logprobs[i] if p.top_logprobs else []
            acc.append(self._position_logprobs(tid, p.logprobs[i], p.ranks[i], top_ids, top_vals))
        if len(acc) == len(group.prompt_token_ids):
            group.prompt_logprobs = acc


def make_request_output(group: SequenceGroup) -> RequestOutput | None:
    """The RequestOutput this step owes the user, by the request's output kind."""
    params = group.sampling_params
    kind = params.output_kind
    finished = group.is_finished()
    # Beams and best_of candidates are only ranked once all are done: nothing to stream.
    final_only = (kind is RequestOutputKind.FINAL_ONLY or params.use_beam_search
                  or params.best_of > params.n)
    if final_only and not finished:
        return None
    if finished and group.metrics.finished_time is None:
        group.metrics.finished_time = time.time()
    delta = kind is RequestOutputKind.DELTA
    # While a sequence runs, hold back the text a stop string could still claim (it would be
    # cut from the final text), as vLLM does: streamed text is never taken back.
    hold = (params.max_stop_len - 1
            if params.stop_strings and not params.include_stop_str_in_output else 0)
    seqs = group.seqs
    ranked = params.use_beam_search or params.best_of > params.n
    if params.best_of > params.n and not params.use_beam_search:
        seqs = sorted(seqs, key=lambda q: q.cumulative_logprob, reverse=True)[:params.n]
    completions = []
    for i, seq in enumerate(seqs):
        sent_tokens, sent_text = group.sent.get(seq.seq_id, (0, 0))
        token_ids = seq.output_token_ids
        logprobs = seq.output_logprobs if params.logprobs is not None else None
        text_end = len(seq.output_text)
        if hold and not seq.status.finished:
            text_end = max(sent_text, text_end - hold)
        text = seq.output_text[:text_end]
        if delta:
            token_ids, text = token_ids[sent_tokens:], text[sent_text:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
            group.sent[seq.seq_id] = (seq.num_output_tokens, text_end)
        completions.append(CompletionOutput(
            index=i, text=text, token_ids=list(token_ids),
            cumulative_logprob=seq.cumulative_logprob if ranked or logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=seq.status.value if seq.status.finished else None,
            stop_reason=seq.stop_reason))
    send_prompt_lp = not delta or not group.prompt_logprobs_sent
    if delta and group.prompt_logprobs is not None:
        group.prompt_logprobs_sent = True
    return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                         prompt_token_ids=group.prompt_token_ids,
                         prompt_logprobs=group.prompt_logprobs if send_prompt_lp else None,
                         outputs=completions, finished=finished, metrics=group.metrics,
                         num_cached_tokens=group.num_cached_tokens)
