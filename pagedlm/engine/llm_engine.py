"""LLMEngine: add_request / abort_request / step, wiring the request's life together.

prompt -> InputPreprocessor -> SequenceGroup in the Scheduler's waiting queue -> each step():
Scheduler.schedule() -> Executor -> Worker -> ModelRunner -> OutputProcessor (decides stops and
forks) -> Scheduler.update_from_output (acts on them) -> RequestOutputs. Step observers (the tracer,
metrics/stats.py) are called around each step; with none registered they cost nothing.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Iterable

from pagedlm.config import EngineConfig
from pagedlm.core.block_manager import BlockManager, plain_pool
from pagedlm.core.sched_output import ExecuteModelRequestBuilder
from pagedlm.core.scheduler import Scheduler
from pagedlm.core.scheduler_output import SchedulerOutput
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.output_processor import (OutputProcessor, make_embedding_output,
                                             make_request_output)
from pagedlm.engine.request_prep import (check_runs_in_engine, check_sampling_limits,
                                         check_some_token_allowed, clamp_max_tokens,
                                         tokenize_bad_words)
from pagedlm.executor.abstract import Executor
from pagedlm.inputs.preprocess import InputPreprocessor, ProcessedPrompt, PromptType
from pagedlm.lora.request import LoRARequest
from pagedlm.metrics.stats import (EngineStats, FinishedStep, ScheduledStep, StepObserver,
                                   StepTimes)
from pagedlm.metrics.tracer import StepTracer, TraceMeta
from pagedlm.model_executor.layers.token_constraints import TokenConstraints
from pagedlm.model_io import ExecuteModelRequest, LoRAStats, ModelRunnerOutput, is_decode
from pagedlm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedlm.pooling_params import PoolingParams
from pagedlm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from pagedlm.sequence import Sequence, SequenceGroup
from pagedlm.structured_output.manager import StructuredOutputManager
from pagedlm.transformers_utils.tokenizer import eos_token_ids, get_tokenizer
from pagedlm.utils import ctrl_c_deferred, ctrl_c_stoppable, run_through_ctrl_c

logger = logging.getLogger(__name__)
_STEP_NOTE = ("pagedlm: Ctrl-C: stopping after this engine step (press it again to stop "
              "sooner)\n")


class LLMEngine:

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        t = time.perf_counter()
        self.tokenizer = get_tokenizer(mc.tokenizer_dir)
        self.eos_token_ids = eos_token_ids(mc.model_dir, self.tokenizer)
        self.input_preprocessor = InputPreprocessor(self.tokenizer, mc.vocab_size)
        self.executor = Executor.get_class(config)(config, self.eos_token_ids)
        try:
            cc = config.cache_config
            # None unless trace_file is set; then it counts the block pools' operations too.
            self.tracer = StepTracer(config.trace_file) if config.trace_file else None
            self.scheduler = Scheduler(
                config.scheduler_config, cc, self.executor.num_gpu_blocks,
                self.executor.num_cpu_blocks,
                pool_factory=plain_pool if self.tracer is None else self.tracer.block_pool,
                speculative_config=config.speculative_config, deterministic=mc.deterministic)
            # Called around every step (step() checks the list is empty, and nothing else runs).
            self.observers: list[StepObserver] = [] if self.tracer is None else [self.tracer]
            self.request_builder = ExecuteModelRequestBuilder()
            self.seq_counter = itertools.count()
            self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                    mc.max_model_len, self.seq_counter)
            self.requests: dict[str, SequenceGroup] = {}  # in the scheduler
            self.stats = EngineStats(self.scheduler.stats)
            if self.tracer is not None:
                sc = config.scheduler_config
                self.tracer.start(TraceMeta(self.block_manager.num_blocks,
                                            self.executor.num_cpu_blocks, cc.block_size,
                                            sc.max_num_batched_tokens, sc.max_num_seqs,
                                            sc.preemption_mode, mc.model))
            # Registered adapters by id (the workers cache and may evict them; a request naming an
            # evicted one makes them load it again from its path).
            self.loras: dict[int, LoRARequest] = {}
            self.structured_output = StructuredOutputManager(
                config.structured_outputs_backend, self.tokenizer, mc.vocab_size,
                self.eos_token_ids, config.structured_outputs_compile_timeout)
            # Requests in the engine that have a grammar: while there are none, no step does any
            # structured-output work.
            self._structured_ids: set[str] = set()
            logger.info("engine ready in %.2fs: %d KV blocks of %d tokens",
                        time.perf_counter() - t, self.block_manager.num_blocks,
                        config.cache_config.block_size)
        except BaseException:
            # Its workers stop too: an error or a Ctrl-C from here on left them (Ray's actors,
            # their placement group and Ray itself) with nothing to stop them, and a retry in
            # the same process waited 120 s for CPUs they held.
            run_through_ctrl_c(self.executor.shutdown)
            raise

    @property
    def block_manager(self) -> BlockManager:
        """The scheduler's (it owns it)."""
        return self.scheduler.block_manager

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # -- LoRA adapters --------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter and load it on every worker now. ValueError naming what is wrong
        (LoRA disabled, a bad path, rank, target module or shape, an id bound to another path or
        name); then no worker keeps it. False if it was already registered."""
        if self.config.lora_config is None:
            raise ValueError("lora_request given, but LoRA is disabled: create the engine "
                             "with enable_lora=True.")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}.")
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_path, known.lora_name) != (lora_request.lora_path,
                                                      lora_request.lora_name):
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already used for "
                                 f"{known.lora_name!r} at {known.lora_path!r}.")
            return False
        errors = self._load_lora(lora_request)
        if errors:
            self.executor.collective_rpc("remove_lora", args=(lora_request.lora_int_id,))
            raise ValueError(errors[0])
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def _load_lora(self, lora_request: LoRARequest) -> list[str]:
        """Load the adapter on every worker unless it is there (each rank's error messages).
        The adapters of unfinished requests are never evicted for it: a step would load them
        again from their files, and files changed or deleted meanwhile made that step fail the
        engine and every request in it. They are loaded here instead, before a request joins."""
        in_use = frozenset(g.lora_int_id for g in self.requests.values() if g.lora_int_id)
        return [e for e in self.executor.collective_rpc("add_lora", args=(lora_request, in_use))
                if e is not None]

    def remove_lora(self, lora_id: int) -> bool:
        """Unregister an adapter; requests still using it are aborted first."""
        if self.loras.pop(lora_id, None) is None:
            return False
        self.abort_request([rid for rid, g in self.requests.items()
                            if g.lora_int_id == lora_id])
        self.executor.collective_rpc("remove_lora", args=(lora_id,))
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())

    def lora_stats(self) -> LoRAStats:
        """The output rank's adapter cache counters (loads, evictions, slot loads)."""
        return self.executor.collective_rpc("lora_stats")[0]

    def running_loras(self) -> list[str]:
        """Names of the adapters of the running requests (the metrics' running adapters)."""
        ids = {g.lora_int_id for g in self.scheduler.running} - {0}
        return sorted(self.loras[i].lora_name for i in ids if i in self.loras)

    @property
    def is_pooling(self) -> bool:
        """runner='pooling': requests take PoolingParams and return embeddings."""
        return self.config.model_config.runner == "pooling"

    def _check_params_kind(self, params) -> None:
        if self.is_pooling and isinstance(params, SamplingParams):
            raise ValueError("This engine runs runner='pooling': it computes embeddings "
                             "(LLM.embed, /v1/embeddings) and cannot generate text. Start "
                             "another with runner='generate' for that.")
        if not self.is_pooling and isinstance(params, PoolingParams):
            raise ValueError("Embeddings need an engine started with runner='pooling' "
                             "(`pagedlm serve --runner pooling`); this one generates text.")
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise ValueError(f"params must be a SamplingParams or PoolingParams, got "
                             f"{type(params).__name__}.")

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """params: SamplingParams on a generating engine, PoolingParams on a pooling one."""
        self._check_params_kind(params)
        if lora_request is not None and not self.add_lora(lora_request):
            # Registered, but perhaps evicted since: loaded again now, outside any step.
            if errors := self._load_lora(lora_request):
                raise ValueError(f"lora_request {lora_request.lora_name!r}: its adapter could "
                                 f"not be loaded again: {errors[0]}")
        pooling = None
        if isinstance(params, PoolingParams):
            mc = self.config.model_config
            params.verify(mc.hidden_size, mc.matryoshka_dimensions, mc.is_matryoshka)
            # One pass over the prompt and no sampling: scheduled as a one-token request.
            pooling, params = params.clone(), SamplingParams(max_tokens=1,
                                                             output_kind=params.output_kind)
        else:
            # A private copy, checked again: its fields are plain attributes, which the caller
            # may have changed since construction (a bad seed would fail inside a step).
            params = params.clone()
            params.verify()
            check_runs_in_engine(params)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if (not isinstance(priority, int) or isinstance(priority, bool)
                or not INT64_MIN <= priority <= INT64_MAX):
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}.")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(f"priority ({priority}) is only used with "
                             f"scheduling_policy='priority'; this engine is 'fcfs'.")
        processed = self.input_preprocessor.process(prompt)
        ids = processed.prompt_token_ids
        max_len = self.config.model_config.max_model_len
        bm = self.block_manager
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token.")
        if len(ids) > max_len:
            raise ValueError(f"prompt is too long: {len(ids)} tokens, but max_model_len is "
                             f"{max_len}.")
        if not bm.can_ever_fit([len(ids)]):
            raise ValueError(f"prompt is too long for the KV cache: it needs "
                             f"{bm.num_blocks_for(len(ids))} blocks of {bm.block_size} tokens, "
                             f"but at most {bm.max_admissible_blocks} can be given to one "
                             f"request ({bm.num_blocks} in the cache, less "
                             f"{bm.watermark_blocks} held back).")
        check_sampling_limits(params, self.config)
        self._prepare_token_constraints(params)
        clamp_max_tokens(params, len(ids), max_len)
        arrival_time = arrival_time or time.time()
        structured = None
        if params.structured_outputs is not None:  # last: the request is otherwise valid
            structured = self.structured_output.register(request_id, params.structured_outputs)
        with ctrl_c_deferred():  # in the engine's map and the scheduler's queue, or neither
            self._add_sequence_group(request_id, processed, params, arrival_time, priority,
                                     lora_request, pooling)
            if structured is not None:
                self.requests[request_id].structured_output = structured
                self._structured_ids.add(request_id)

    def _prepare_token_constraints(self, params: SamplingParams) -> None:
        """Tokenize bad_words unless the caller's side did (engine/request_prep.py); build the
        sampler's tensors. Linear in the lists, once (check_sampling_limits checked them)."""
        vocab = self.config.model_config.vocab_size
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = tokenize_bad_words(self.tokenizer, params.bad_words)
        check_some_token_allowed(params, self.eos_token_ids)
        params.token_constraints = TokenConstraints.build(params, vocab)

    def _add_sequence_group(self, request_id: str, processed: ProcessedPrompt,
                            params: SamplingParams, arrival_time: float, priority: int,
                            lora_request: LoRARequest | None = None,
                            pooling_params: PoolingParams | None = None) -> None:
        ids = processed.prompt_token_ids
        lora_key = None
        if lora_request is not None:
            lora_key = (lora_request.lora_int_id, lora_request.lora_path)
        seq = Sequence(next(self.seq_counter), list(ids), len(ids),
                       cache_salt=processed.cache_salt, lora_key=lora_key)
        seq.detok = self.output_processor.detokenizer.init_state(ids, params.skip_special_tokens)
        group = SequenceGroup(request_id, [seq], params, processed.prompt, list(ids),
                              arrival_time=arrival_time, priority=priority,
                              lora_request=lora_request, pooling_params=pooling_params)
        self.requests[request_id] = group
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        with ctrl_c_deferred(second_stops=False):  # a group taken off its queue is freed
            self._structured_ids -= ids
            for group in self.scheduler.abort(ids):
                self.requests.pop(group.request_id, None)
                self.request_builder.request_finished(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the executor's workers (worker processes or actors) and write the trace, if
        tracing; idempotent."""
        for observer in self.observers:
            observer.engine_stops(self.scheduler)
        self.structured_output.shutdown()
        self.executor.shutdown()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens found in the prefix cache."""
        return self.block_manager.prefix_hit_rate()

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One step: schedule, run the model, process its outputs. A Ctrl-C waits for the step
        to end, a second one only for the model's run (or its start): interrupted at any line
        of the scheduler's or the output processor's bookkeeping, the engine kept half of it
        (a group out of every queue holding its blocks, a block counted twice or never, a
        request the next call ran), which no abort could find."""
        with ctrl_c_deferred(_STEP_NOTE, second_stops=False):
            try:
                return self._run_step()
            except BaseException:
                # The step's K/V may never have been written (a second Ctrl-C, one in the
                # forward, a failed worker), and the blocks its schedule registered in the
                # prefix cache would give later prompts that garbage as their prefix (wrong
                # tokens, for good). Computed ones are only lost to the cache.
                self.block_manager.forget_step_registrations()
                raise

    def _run_step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        t0 = time.perf_counter()
        aborted = self._abort_failed_grammars() if self._structured_ids else []
        observers = self.observers
        for observer in observers:
            observer.step_begins(self.scheduler)
        sched = self.scheduler.schedule()
        if not observers:
            return self._step(sched, t0, aborted)
        scheduled = ScheduledStep(t0, time.perf_counter(), sched, self.scheduler)
        for observer in observers:
            observer.step_scheduled(scheduled)
        model = self.stats.model_times()
        outputs = self._step(sched, t0, aborted)
        t2 = time.perf_counter()
        p, f, s = (a - b for a, b in zip(self.stats.model_times(), model))
        times = StepTimes(schedule=scheduled.scheduled - t0, prepare=p, forward=f, sample=s,
                          output=t2 - scheduled.scheduled - p - f - s)
        finished = FinishedStep(sched, self.scheduler, t2, times)
        for observer in observers:
            observer.step_finished(finished)
        return outputs

    def _step(self, sched: SchedulerOutput, t0: float,
              aborted: list[RequestOutput]) -> list[RequestOutput | EmbeddingRequestOutput]:
        if sched.is_empty:
            if self._structured_ids and self.structured_output.has_pending:
                # Only requests waiting for their grammars: wait for one, do not spin.
                self.structured_output.wait_for_pending(timeout=0.05)
            return aborted
        # (group, finished) pairs; finished without running: still reported.
        reported = [(g, True) for g in sched.ignored_groups]
        if sched.scheduled_groups:
            self._execute(sched)
            for sg in sched.scheduled_groups:
                finished = sg.group.is_finished()
                if finished or any(sg.num_samples):
                    reported.append((sg.group, finished))
        elif sched.has_cache_ops:  # everything was swapped out: the copies must still happen
            self._execute_model(self.request_builder.build(sched))
        now = time.time()
        outputs = aborted
        for group, finished in reported:
            if finished:
                group.metrics.finished_time = group.metrics.finished_time or now
                self.requests.pop(group.request_id, None)
                self._structured_ids.discard(group.request_id)
                self.request_builder.request_finished(group)
            if group.pooling_params is not None:
                if (embedded := make_embedding_output(group)) is not None:
                    outputs.append(embedded)
                continue
            report = make_request_output(group, finished)
            if report is None:
                continue
            out, group.cursor = report
            outputs.append(out)
        self.stats.step_time += time.perf_counter() - t0
        return outputs

    def _abort_failed_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile (validation passed, so rarely): aborted,
        with a final output so that their callers are not left waiting."""
        outputs = []
        for rid, error in self.structured_output.take_failed():
            group = self.requests.get(rid)
            if group is None:
                continue
            logger.error("request %s: its grammar failed to compile: %s", rid, error)
            self.abort_request(rid)
            report = make_request_output(group)
            if report is not None:
                outputs.append(report[0])
        return outputs

    def _execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput | None:
        try:
            with ctrl_c_stoppable():  # (the step's one place a second Ctrl-C stops at once)
                return self.executor.execute_model(request)
        except BaseException:
            self.request_builder.not_delivered(request)
            raise

    def _execute(self, sched: SchedulerOutput) -> None:
        request = self.request_builder.build(sched)
        if self._structured_ids:  # (its time shows as the scheduler's in the breakdown)
            request.grammar_bitmask = self.structured_output.grammar_bitmask(
                sched.scheduled_groups)
        t1 = time.perf_counter()
        result = self._execute_model(request)
        st = self.stats
        st.model_time += time.perf_counter() - t1
        st.prepare_time += result.timings.prepare_s
        st.forward_time += result.timings.forward_s
        st.sample_time += result.timings.sample_s
        st.comm_time += result.timings.comm_s
        st.num_steps += 1
        prompt_tokens = 0
        for sg in sched.scheduled_groups:  # (a plain loop: a generator cost twice as much)
            for s, n in zip(sg.seqs, sg.num_new_tokens):
                if not is_decode(s.num_computed_tokens, n):
                    prompt_tokens += n
        st.num_prompt_tokens += prompt_tokens
        st.num_generation_tokens += len(result.sampler_output.sampled_token_ids)
        if result.num_emitted:  # a verifying sequence's rows are its drafts + 1, not emitted
            st.num_generation_tokens += sum(result.num_emitted.values()) - sum(
                n + 1 for n in result.num_drafts.values())
        if result.pooled is not None:
            updates = self.output_processor.process_pooled(
                sched, result, self.config.model_config.pooler_config.normalize)
        else:
            updates = self.output_processor.process(sched, result)
        self.scheduler.update_from_output(sched, updates)
        for seq, _ in updates.finished:
            self.request_builder.seq_finished(seq)
