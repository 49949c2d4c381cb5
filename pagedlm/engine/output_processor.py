"""Output processing: append sampled tokens, detokenize, decide stops and forks, build outputs.

It reports and the scheduler acts: `process` returns the forks and finished sequences as a
SequenceUpdates, and Scheduler.update_from_output shares, frees and finishes. Building a
RequestOutput (`make_request_output`) changes nothing: the caller keeps the returned cursor.
"""
from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from pagedlm.core.scheduler_output import SchedulerOutput
from pagedlm.engine.detokenizer import IncrementalDetokenizer
from pagedlm.engine.stop_checker import StopDecision, check_stop
from pagedlm.model_executor.layers.pooler import finalize_embedding
from pagedlm.model_io import ModelRunnerOutput, PromptLogprobs
from pagedlm.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                             PositionLogprobs, RequestOutput)
from pagedlm.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.sequence import (OutputCursor, Sequence, SequenceGroup, SequenceStatus,
                              SequenceUpdates)
from pagedlm.structured_output.request import GrammarStep


class OutputProcessor:

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                 max_model_len: int, next_seq_id) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.next_seq_id = next_seq_id
        # One token's text, by id: a logprobs position names up to 21 candidates, each once
        # decoded inside the engine's step (echoing 256 prompts of 60 tokens with 20
        # alternatives spent 1.35 s of the step in decode). At most the vocabulary's size.
        self._token_texts: dict[int, str] = {}

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def process(self, sched_out: SchedulerOutput, result: ModelRunnerOutput) -> SequenceUpdates:
        now = time.time()
        s = result.sampler_output
        sampled = s.sampled_token_ids
        # Rows carry logprobs only where some request asked: otherwise no per-token lookups.
        lp_rows = s.sampled_logprobs is not None
        row_lp = self._row_logprobs
        updates = SequenceUpdates()
        for sg in sched_out.scheduled_groups:
            group = sg.group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            for seq, k in zip(sg.seqs, sg.num_samples):
                if k == 0:
                    continue  # mid-prompt: nothing sampled yet
                row = result.first_sample_row[seq.seq_id]
                # A prompt sampled k > 1 times forks into k sequences sharing its blocks.
                targets = [seq]
                for _ in range(k - 1):
                    child = seq.fork(next(self.next_seq_id))
                    updates.forks.append((group, seq, child))
                    targets.append(child)
                if result.multi_step_emitted:  # the step's iterations
                    num_emitted = result.multi_step_emitted[seq.seq_id]
                    if (not self._append_run(group, seq, s, row, num_emitted, lp_rows, updates)
                            and num_emitted > 1):
                        updates.multi_step.append((seq, num_emitted - 1))
                    continue
                num_emitted = result.num_emitted.get(seq.seq_id) if result.num_emitted else None
                if num_emitted is not None:
                    # A verification: its accepted drafts and one more token.
                    num_drafts = result.num_drafts[seq.seq_id]
                    updates.spec.append((seq, num_drafts, num_emitted - 1))
                    self._append_run(group, seq, s, row, num_emitted, lp_rows, updates)
                    continue
                for target in targets:
                    status = self._append_token(group, target, sampled[row],
                                                row_lp(s, row) if lp_rows else None)
                    if status is not None:
                        updates.finished.append((target, status))
                    row += 1
            if any(sg.num_samples) and group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            if (p := result.prompt_logprobs.get(group.request_id)) is not None:
                self._add_prompt_logprobs(group, p)
        return updates

    def _append_run(self, group: SequenceGroup, seq: Sequence, s, row: int, num: int,
                    lp_rows: bool, updates: SequenceUpdates) -> bool:
        """Append the sampler output's rows row .. row+num-1 to seq one at a time, with every
        stop check; a stop drops the rest. Returns whether seq finished."""
        for r in range(row, row + num):
            status = self._append_token(group, seq, s.sampled_token_ids[r],
                                        self._row_logprobs(s, r) if lp_rows else None)
            if status is not None:
                updates.finished.append((seq, status))
                return True
        return False

    @staticmethod
    def _row_logprobs(s, row: int):
        if s.sampled_logprobs is None:
            return None
        return (s.sampled_logprobs[row], s.ranks[row],
                s.top_token_ids[row] if s.top_token_ids else [],
                s.top_logprobs[row] if s.top_logprobs else [])

    def process_pooled(self, sched_out: SchedulerOutput, result: ModelRunnerOutput,
                       default_normalize: bool) -> SequenceUpdates:
        """The pooling runner's step: a prompt that completed has its embedding and is done
        (its KV blocks are freed by the scheduler like any finished sequence's)."""
        now = time.time()
        updates = SequenceUpdates()
        for sg in sched_out.scheduled_groups:
            group = sg.group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            for seq in sg.seqs:
                vec = result.pooled.get(seq.seq_id)
                if vec is None:
                    continue  # mid-prompt
                group.embedding = finalize_embedding(vec, group.pooling_params,
                                                     default_normalize)
                group.metrics.first_token_time = now
                seq.stop_reason = None
                updates.finished.append((seq, SequenceStatus.FINISHED_STOPPED))
        return updates

    def _append_token(self, group: SequenceGroup, seq: Sequence, token_id: int,
                      lp) -> SequenceStatus | None:
        """Append the token, its logprobs and its text; returns the status if seq stopped."""
        params = group.sampling_params
        # Advanced before the token is appended: a sequence new to its matcher replays the
        # output it had so far.
        grammar = (group.structured_output.accept_token(seq, token_id)
                   if group.structured_output is not None else None)
        if grammar is GrammarStep.BREAKS or not _allowed(params, token_id):
            seq.stop_reason = None
            return SequenceStatus.FINISHED_STOPPED
        seq.token_ids.append(token_id)
        if lp is not None:
            logprob, rank, top_ids, top_vals = lp
            seq.cumulative_logprob += logprob
            if params.logprobs is not None:
                seq.output_logprobs.append(self._position_logprobs(
                    token_id, logprob, rank, top_ids[:params.logprobs],
                    top_vals[:params.logprobs]))
        delta = self.detokenizer.step(seq.detok, token_id, params.skip_special_tokens)
        if delta:
            seq.output_text += delta
        stop = check_stop(params, self.eos_token_ids, self.max_model_len, len(seq.token_ids),
                          seq.num_output_tokens, token_id, seq.output_text, len(delta))
        if stop is None and grammar is GrammarStep.COMPLETES:  # nothing more (ignore_eos too)
            stop = StopDecision(SequenceStatus.FINISHED_STOPPED)
        if stop is None:
            return None
        if stop.text_end is not None:
            seq.output_text = seq.output_text[:stop.text_end]
        seq.stop_reason = stop.stop_reason
        return stop.status

    def _position_logprobs(self, token_id: int, logprob: float, rank: int, top_ids: list[int],
                           top_vals: list[float]) -> PositionLogprobs:
        entry = {token_id: Logprob(logprob, rank, self._token_text(token_id))}
        for r, (tid, val) in enumerate(zip(top_ids, top_vals), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, r, self._token_text(tid))
        return entry

    def _add_prompt_logprobs(self, group: SequenceGroup, p: PromptLogprobs) -> None:
        # Accumulate chunk by chunk; the first prompt token has nothing to be scored against.
        acc = group.partial_prompt_logprobs
        if not acc:
            acc.append(None)
        # A prompt prefilled again (recompute preemption mid-prompt) scores positions it had
        # scored: they replace those, or the list outgrew the prompt and never completed (the
        # request's prompt_logprobs came back None).
        del acc[p.first_position:]
        for i, tid in enumerate(p.token_ids):
            top_ids = p.top_token_ids[i] if p.top_token_ids else []
            top_vals = p.top_logprobs[i] if p.top_logprobs else []
            acc.append(self._position_logprobs(tid, p.logprobs[i], p.ranks[i], top_ids, top_vals))
        if len(acc) == len(group.prompt_token_ids):
            group.prompt_logprobs = acc


def _allowed(params: SamplingParams, token_id: int) -> bool:
    """Whether token_id is in the request's allow list (if it has one). A token outside it was
    drawn from a row with nothing left to sample: multi-token bad words can mask the rest of
    the list after some output (check_some_token_allowed refuses what the request alone
    shows). The sequence ends before it, as for a token its grammar refuses."""
    tc = params.token_constraints
    return tc is None or tc.allowed is None or token_id in tc.allowed


def make_request_output(group: SequenceGroup, finished: bool | None = None
                        ) -> tuple[RequestOutput, OutputCursor] | None:
    """The RequestOutput this step owes the user, by the request's output kind, and the cursor
    to keep for the next one (what has now been sent). None: nothing to report yet. finished:
    group.is_finished(), where the caller already knows it."""
    params = group.sampling_params
    kind = params.output_kind
    if finished is None:
        finished = group.is_finished()
    ranked = params.ranked_at_end
    if (kind is RequestOutputKind.FINAL_ONLY or ranked) and not finished:
        return None
    delta = kind is RequestOutputKind.DELTA
    # While a sequence runs, hold back the text a stop string could still claim (it would be
    # cut from the final text), as vLLM does: streamed text is never taken back.
    hold = (params.max_stop_len - 1
            if params.stop_strings and not params.include_stop_str_in_output else 0)
    seqs = group.seqs
    if ranked:
        seqs = sorted(seqs, key=lambda q: q.cumulative_logprob, reverse=True)[:params.n]
    sent = dict(group.cursor.sent) if delta else group.cursor.sent  # only DELTA advances it
    finish_sent = group.cursor.finish_sent
    completions = []
    for i, seq in enumerate(seqs):
        if delta and seq.seq_id in finish_sent:
            # Said once: a finished sequence repeated in every later delta of its group gave a
            # stream's choice its finish_reason again on every step (n > 1).
            continue
        sent_tokens, sent_text = sent.get(seq.seq_id, (0, 0))
        token_ids = seq.output_token_ids
        logprobs = seq.output_logprobs if params.logprobs is not None else None
        text_end = len(seq.output_text)
        if hold and not seq.status.finished:
            text_end = max(sent_text, text_end - hold)
        text = seq.output_text[:text_end]
        if delta:
            token_ids, text = token_ids[sent_tokens:], text[sent_text:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
            sent[seq.seq_id] = (seq.num_output_tokens, text_end)
            if seq.status.finished:
                finish_sent = finish_sent | {seq.seq_id}
        completions.append(CompletionOutput(
            index=i, text=text, token_ids=list(token_ids),
            cumulative_logprob=seq.cumulative_logprob if ranked or logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=seq.status.value if seq.status.finished else None,
            stop_reason=seq.stop_reason))
    send_prompt_lp = not delta or not group.cursor.prompt_logprobs_sent
    cursor = OutputCursor(sent, group.cursor.prompt_logprobs_sent
                          or (delta and group.prompt_logprobs is not None), finish_sent)
    output = RequestOutput(request_id=group.request_id, prompt=group.prompt,
                           prompt_token_ids=group.prompt_token_ids,
                           prompt_logprobs=group.prompt_logprobs if send_prompt_lp else None,
                           outputs=completions, finished=finished, metrics=group.metrics,
                           num_cached_tokens=group.num_cached_tokens)
    return output, cursor


def make_embedding_output(group: SequenceGroup) -> EmbeddingRequestOutput | None:
    """A pooling request's output, once it finished (None before; an aborted one has no
    embedding: an empty one is reported so its waiter is released)."""
    if not group.is_finished():
        return None
    return EmbeddingRequestOutput(group.request_id, EmbeddingOutput(group.embedding or []),
                                  group.prompt_token_ids, True, group.metrics,
                                  group.num_cached_tokens)
