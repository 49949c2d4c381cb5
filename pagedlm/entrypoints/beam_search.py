"""Beam search above the engine (as vLLM's LLM.beam_search): ordinary requests, ranked here.

Each step every live beam becomes a one-token request (prompt + the beam's tokens) asking for the
top 2 * beam_width logprobs. The engine serves these like any request: beams that share a prefix
share its KV blocks through prefix caching, so only the last, partly filled block of each beam is
computed again. Once all of a step's requests are back, the best candidates by cumulative logprob
become the next beams. Candidates that end (EOS, a stop token, the length limit: the engine's one
stop check) become finished hypotheses, scored as transformers does: cumulative logprob /
generated_length ** length_penalty; the search ends by transformers' rules for early_stopping,
so results match its beam search token for token.

The engine knows nothing of this. BeamSearch is the search's state; two drivers feed it: the
offline BeamSearchDriver below, which LLM steps in place of the bare LLMEngine, and the server's
BeamSearchStream (entrypoints/openai/serving_beam_search.py) over the AsyncLLMEngine. Both
report only the final, ranked RequestOutput.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from pagedlm.config import EngineConfig
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.request_prep import check_sampling_limits, clamp_max_tokens
from pagedlm.engine.stop_checker import check_stop
from pagedlm.inputs.preprocess import PromptType
from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import (CompletionOutput, EmbeddingRequestOutput, PositionLogprobs,
                             RequestMetrics, RequestOutput)
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.sequence import SequenceStatus
from pagedlm.utils import ctrl_c_deferred


@dataclass
class _Beam:
    token_ids: list[int] = field(default_factory=list)  # generated so far
    cumulative_logprob: float = 0.0
    # Each generated token's logprobs, where the request asks for them (params.logprobs).
    logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass
class _Hypothesis:
    score: float  # cumulative logprob / generated_length ** length_penalty
    token_ids: list[int]
    cumulative_logprob: float
    status: SequenceStatus
    stop_reason: int | None
    logprobs: list[PositionLogprobs]


@dataclass
class BeamStepRequest:
    """One beam's request for the next step, to be added to the engine as is."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None

    @property
    def prompt(self) -> dict:
        """The engine's prompt: the beam's tokens, with the search's cache salt."""
        if self.cache_salt is None:
            return {"prompt_token_ids": self.prompt_token_ids}
        return {"prompt_token_ids": self.prompt_token_ids, "cache_salt": self.cache_salt}


class BeamSearch:

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_ids: frozenset[int], max_model_len: int,
                 tokenizer, arrival_time: float, cache_salt: str | None = None,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        # What each step request carries on: the same salt, priority and adapter.
        self.cache_salt = cache_salt
        self.priority = priority
        self.lora_request = lora_request
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
        # None: the engine refused the step request (it outgrew the KV cache).
        self.results: dict[str, RequestOutput | None] = {}
        self.prompt_logprobs = None
        self.num_cached_tokens = 0

    def next_requests(self) -> list[BeamStepRequest]:
        first = self.num_steps == 0
        step_params = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True,
            logprobs=max(2 * self.width, self.params.logprobs or 0),
            prompt_logprobs=self.params.prompt_logprobs if first else None,
            skip_special_tokens=self.params.skip_special_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY)
        self.pending, self.results = {}, {}
        requests = []
        for i, beam in enumerate(self.live):
            rid = f"{self.request_id}#beam{self.num_steps}.{i}"
            self.pending[rid] = beam
            requests.append(BeamStepRequest(rid, self.prompt_token_ids + beam.token_ids,
                                            step_params, self.cache_salt))
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

    def refused(self, request_id: str) -> bool:
        """The engine refused a later step's request (it outgrew the KV cache): the beam ends
        as if it had run and been ignored. True once all of this step's are in."""
        self.results[request_id] = None
        return len(self.results) == len(self.pending)

    @property
    def is_first_step(self) -> bool:
        return self.num_steps == 1

    def advance(self) -> None:
        """Rank this step's candidates into the next beams and finished hypotheses."""
        width = self.width
        candidates = []  # (cumulative logprob, parent index, token id, logprob)
        positions: dict[int, list] = {}  # parent index -> its step's logprobs, best rank first
        for index, (rid, parent) in enumerate(self.pending.items()):
            result = self.results[rid]
            completion = result.outputs[0] if result is not None else None
            if completion is None or not completion.logprobs:
                continue  # the step request could not run (it outgrew the KV cache)
            top = sorted(completion.logprobs[0].items(), key=lambda kv: kv[1].rank)
            positions[index] = top
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
                    self._add_finished(parent, tid, score, stop.status, stop.stop_reason,
                                       self._position(positions[index], tid))
            elif num_live < width:
                continuations.setdefault(index, []).append((tid, lp, positions[index]))
                num_live += 1
                if num_live == 1:
                    best_running = score
        # Surviving parents (in order) take their best continuation; extra ones follow, in the
        # order a fork would have appended them.
        firsts, extras = [], []
        for index, parent in enumerate(self.live):
            for j, (tid, lp, top) in enumerate(continuations.get(index, [])):
                position = self._position(top, tid)
                beam = _Beam(parent.token_ids + [tid], parent.cumulative_logprob + lp,
                             parent.logprobs + [position] if position is not None else [])
                (extras if j else firsts).append(beam)
        self.live = firsts + extras
        if num_live == 0 or self._is_done(best_running):
            self._finish()

    def _position(self, top: list, tid: int) -> PositionLogprobs | None:
        """The logprobs of a step's token `tid` as an ordinary request reports them: it, and
        the params.logprobs most likely tokens; None where the request asks for none."""
        k = self.params.logprobs
        if k is None:
            return None
        return {t: lp for t, lp in top if lp.rank <= k or t == tid}

    def _add_finished(self, parent: _Beam, tid: int | None, cumulative: float,
                      status: SequenceStatus, stop_reason: int | None = None,
                      position: PositionLogprobs | None = None) -> None:
        sp = self.params
        if sp.early_stopping is True and len(self.hypotheses) == self.width:
            return
        tokens = parent.token_ids + ([tid] if tid is not None else [])
        logprobs = parent.logprobs + ([position] if position is not None else [])
        score = cumulative / (max(1, len(tokens)) ** sp.length_penalty)
        self.hypotheses.append(_Hypothesis(score, tokens, cumulative, status, stop_reason,
                                           logprobs))
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
                             logprobs=(h.logprobs if self.params.logprobs is not None
                                       else None), finish_reason=h.status.value,
                             stop_reason=h.stop_reason)
            for i, h in enumerate(self.hypotheses[:self.params.n])]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs, outputs=completions,
                             finished=True, metrics=self.metrics,
                             num_cached_tokens=self.num_cached_tokens)


def new_beam_search(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, config: EngineConfig, eos_token_ids: frozenset[int],
                    tokenizer, arrival_time: float, cache_salt: str | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> BeamSearch:
    """A search for a use_beam_search request, which is checked here as the engine checks a
    request (a private copy; ValueError naming the field). The prompt itself is checked when
    the first step's requests are added."""
    if config.speculative_config is not None:
        # The field first: the server reports an error's first word as its param.
        raise ValueError(f"use_beam_search: beam search (LLM.beam_search too) is not supported "
                         f"on an engine with speculative_config (method "
                         f"{config.speculative_config.method!r}): start one without it.")
    params = params.clone()  # the caller may change its copy's plain attributes later
    params.verify()
    check_sampling_limits(params, config)
    mc = config.model_config
    limit = mc.vocab_size if mc.max_logprobs < 0 else mc.max_logprobs
    if 2 * params.best_of > limit:
        # best_of is n unless the request set it higher: name the field it set.
        name = "best_of" if params.best_of > params.n else "n"
        raise ValueError(f"{name} ({params.best_of}) is too large for beam search: each step "
                         f"ranks 2 * {name} candidates per beam, past max_logprobs "
                         f"({mc.max_logprobs}).")
    clamp_max_tokens(params, len(prompt_token_ids), mc.max_model_len)
    return BeamSearch(request_id, prompt, list(prompt_token_ids), params, eos_token_ids,
                      mc.max_model_len, tokenizer, arrival_time, cache_salt, priority,
                      lora_request)


class BeamSearchDriver:
    """LLMEngine's add_request / abort_request / step / has_unfinished_requests, with
    use_beam_search requests run as searches: each step's one-token requests are added to the
    engine, their outputs routed back here, and only a search's final output is reported.
    Other requests pass through untouched. Single-threaded, as the engine is."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.searches: dict[str, BeamSearch] = {}
        self._search_of: dict[str, BeamSearch] = {}  # step request id -> its search

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        if request_id in self.searches:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if not (isinstance(params, SamplingParams) and params.use_beam_search):
            self.engine.add_request(request_id, prompt, params, arrival_time, priority,
                                    lora_request)
            return
        if request_id in self.engine.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        engine = self.engine
        processed = engine.input_preprocessor.process(prompt)
        search = new_beam_search(request_id, processed.prompt, processed.prompt_token_ids,
                                 params, engine.config, engine.eos_token_ids, engine.tokenizer,
                                 arrival_time or time.time(), processed.cache_salt, priority,
                                 lora_request)
        # The engine checks the prompt: nothing is left on a refusal. A Ctrl-C waits: its step
        # requests in the engine with no search to abort them by were run by the next call.
        with ctrl_c_deferred():
            self._add_step(search)
            self.searches[request_id] = search

    def _add_step(self, search: BeamSearch) -> None:
        added = []
        for req in search.next_requests():
            try:
                self.engine.add_request(req.request_id, req.prompt, req.params,
                                        search.metrics.arrival_time, search.priority,
                                        search.lora_request)
            except ValueError:
                if search.is_first_step:  # the user's request itself is refused
                    self.engine.abort_request(added)
                    raise
                search.refused(req.request_id)
                continue
            added.append(req.request_id)
            self._search_of[req.request_id] = search
        if not added:  # every beam outgrew the cache: rank what there is now
            self._advance(search)

    def _advance(self, search: BeamSearch) -> RequestOutput | None:
        """Rank a completed step; the final output if the search is over, else the next step is
        in the engine."""
        search.advance()
        if search.done:
            del self.searches[search.request_id]
            return search.request_output()
        self._add_step(search)
        return search.request_output() if search.done else None

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """A search's id aborts its pending step requests; unknown ids are ignored."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        # A step's id stands for its whole search: a search never waits on a lost step.
        ids |= {self._search_of[rid].request_id for rid in ids & self._search_of.keys()}
        for rid in ids & self.searches.keys():
            search = self.searches.pop(rid)
            ids |= search.pending.keys()
            for step_id in search.pending:
                self._search_of.pop(step_id, None)
        self.engine.abort_request(ids)

    def abort_all(self) -> None:
        """Every search and request: those of an LLM call that was interrupted."""
        self.abort_request(list(self.searches) + list(self.engine.requests))

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        outputs = []
        for out in self.engine.step():
            search = self._search_of.pop(out.request_id, None)
            if search is None:
                outputs.append(out)
            elif search.add_output(out) and (final := self._advance(search)) is not None:
                outputs.append(final)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests as users see them: a search counts once."""
        return (self.engine.get_num_unfinished_requests() - len(self._search_of)
                + len(self.searches))
