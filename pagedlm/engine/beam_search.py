"""Beam search on top of the engine (as vLLM's LLM.beam_search): ordinary requests, ranked here.

Each step every live beam becomes a one-token request (prompt + the beam's tokens) asking for the
top 2 * beam_width logprobs. The engine serves these like any request: beams that share a prefix
share its KV blocks through prefix caching, so only the last, partly filled block of each beam is
computed again. Once all of a step's requests are back, the best candidates by cumulative logprob
become the next beams. Candidates that end (EOS, a stop token, the length limit: the engine's one
stop check) become finished hypotheses, scored as transformers does: cumulative logprob /
generated_length ** length_penalty; the search ends by transformers' rules for early_stopping,
so results match its beam search token for token.

The scheduler, model runner and output processor know nothing of this: LLMEngine routes the
step requests' outputs here and reports only the final, ranked RequestOutput.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedlm.engine.stop_checker import check_stop
from pagedlm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedlm.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.sequence import SequenceStatus


@dataclass
class _Beam:
    token_ids: list[int] = field(default_factory=list)  # generated so far
    cumulative_logprob: float = 0.0


@dataclass
class _Hypothesis:
    score: float  # cumulative logprob / generated_length ** length_penalty
    token_ids: list[int]
    cumulative_logprob: float
    status: SequenceStatus
    stop_reason: int | None


@dataclass
class BeamStepRequest:
    """One beam's request for the next step, to be added to the engine as is."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class BeamSearch:

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_ids: frozenset[int], max_model_len: int,
                 tokenizer, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.width = params.best_of
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.live: list[_Beam] = [_Beam()]
        self.hypotheses: list[_Hypothesis] = []  # best first, at most beam_width
        self.done = False
        self.num_steps = 0
        self.pending: dict[str, _Beam] = {}  # this step's request id -> its beam
        self.results: dict[str, RequestOutput] = {}
        self.prompt_logprobs = None
        self.num_cached_tokens = 0

    def next_requests(self) -> list[BeamStepRequest]:
        first = self.num_steps == 0
        step_params = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * self.width, ignore_eos=True,
            prompt_logprobs=self.params.prompt_logprobs if first else None,
            skip_special_tokens=self.params.skip_special_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY)
        self.pending, self.results = {}, {}
        requests = []
        for i, beam in enumerate(self.live):
            rid = f"{self.request_id}#beam{self.num_steps}.{i}"
            self.pending[rid] = beam
            requests.append(BeamStepRequest(rid, self.prompt_token_ids + beam.token_ids,
                                            step_params))
        self.num_steps += 1
        return requests

    def add_output(self, output: RequestOutput) -> bool:
        """A step request finished; True once all of this step's are in."""
        self.results[output.request_id] = output
        complete = len(self.results) == len(self.pending)
        if self.num_steps == 1:
            m = self.metrics
            m.first_scheduled_time = m.first_scheduled_time or output.metrics.first_scheduled_time
            if complete:
                m.first_token_time = time.time()
            self.prompt_logprobs = self.prompt_logprobs or output.prompt_logprobs
            self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        return complete

    def advance(self) -> None:
        """Rank this step's candidates into the next beams and finished hypotheses."""
        width = self.width
        candidates = []  # (cumulative logprob, parent index, token id, logprob)
        for index, (rid, parent) in enumerate(self.pending.items()):
            completion = self.results[rid].outputs[0]
            if not completion.logprobs:
                continue  # the step request could not run (it outgrew the KV cache)
            top = sorted(completion.logprobs[0].items(), key=lambda kv: kv[1].rank)
            for tid, lp in top[:2 * width]:
                candidates.append((parent.cumulative_logprob + lp.logprob, index, tid,
                                   lp.logprob))
        if not candidates:
            for beam in self.live:
                self._add_finished(beam, None, beam.cumulative_logprob,
                                   SequenceStatus.FINISHED_LENGTH)
            self._finish()
            return
        candidates.sort(key=lambda c: c[0], reverse=True)

        continuations: dict[int, list[tuple[int, float]]] = {}
        num_live, best_running = 0, 0.0
        for rank, (score, index, tid, lp) in enumerate(candidates[:2 * width]):
            parent = self.live[index]
            stop = check_stop(self.params, self.eos_token_ids, self.max_model_len,
                              len(self.prompt_token_ids) + len(parent.token_ids) + 1,
                              len(parent.token_ids) + 1, tid)
            if stop is not None:
                # Only the top beam_width candidates may finish, as in transformers.
                if rank < width:
                    self._add_finished(parent, tid, score, stop.status, stop.stop_reason)
            elif num_live < width:
                continuations.setdefault(index, []).append((tid, lp))
                num_live += 1
                if num_live == 1:
                    best_running = score
        # Surviving parents (in order) take their best continuation; extra ones follow, in the
        # order a fork would have appended them.
        firsts, extras = [], []
        for index, parent in enumerate(self.live):
            for j, (tid, lp) in enumerate(continuations.get(index, [])):
                beam = _Beam(parent.token_ids + [tid], parent.cumulative_logprob + lp)
                (extras if j else firsts).append(beam)
        self.live = firsts + extras
        if num_live == 0 or self._is_done(best_running):
            self._finish()

    def _add_finished(self, parent: _Beam, tid: int | None, cumulative: float,
                      status: SequenceStatus, stop_reason: int | None = None) -> None:
        sp = self.params
        if sp.early_stopping is True and len(self.hypotheses) == self.width:
            return
        tokens = parent.token_ids + ([tid] if tid is not None else [])
        score = cumulative / (max(1, len(tokens)) ** sp.length_penalty)
        self.hypotheses.append(_Hypothesis(score, tokens, cumulative, status, stop_reason))
        self.hypotheses.sort(key=lambda h: h.score, reverse=True)
        del self.hypotheses[self.width:]

    def _is_done(self, best_running: float) -> bool:
        """transformers' stopping rule, checked after the step."""
        sp = self.params
        if len(self.hypotheses) < self.width:
            return False
        if sp.early_stopping is True:
            return True
        gen_len = len(self.live[0].token_ids)
        if sp.early_stopping == "never" and sp.length_penalty > 0:
            gen_len = sp.max_tokens
        return best_running / (gen_len ** sp.length_penalty) <= self.hypotheses[-1].score

    def _finish(self) -> None:
        self.done = True
        self.live = []
        self.metrics.finished_time = time.time()

    def request_output(self) -> RequestOutput:
        """The final output: the n best hypotheses, best first."""
        completions = [
            CompletionOutput(index=i, text=self.tokenizer.decode(
                                 h.token_ids, skip_special_tokens=self.params.skip_special_tokens),
                             token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob,
                             logprobs=None, finish_reason=h.status.value,
                             stop_reason=h.stop_reason)
            for i, h in enumerate(self.hypotheses[:self.params.n])]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs, outputs=completions,
                             finished=True, metrics=self.metrics,
                             num_cached_tokens=self.num_cached_tokens)
