"""AsyncLLMEngine: the LLMEngine's step loop on a background thread, for asyncio callers.

LLMEngine.step() is synchronous and CPU-bound (torch releases the GIL in its kernels), so one
dedicated engine thread owns the LLMEngine and is the only thread that touches it. Callers on an
asyncio event loop send it new requests and aborts through a thread-safe queue; it hands each
request's RequestOutputs back to that request's asyncio queue through its loop's channel
(engine/loop_channel.py: call_soon_threadsafe's order, without its GIL hand-off).

    engine = AsyncLLMEngine.from_engine_args(EngineArgs())
    params = SamplingParams(max_tokens=32, output_kind=RequestOutputKind.DELTA)
    async for out in engine.generate("Hello", params, request_id="r1"):
        print(out.outputs[0].text, end="")

Closing or cancelling the iterator aborts the request (its KV blocks are freed). A request the
engine rejects raises its ValueError from add_request()/the first iteration. If step() raises,
or a worker process dies (found by the step, or between steps while the engine is idle), the
cause is logged once, every in-flight request's iterator raises that error and the engine is
dead: `errored` turns True and later requests get AsyncEngineDeadError. The engine never
restarts itself: whoever runs it stops (`pagedlm serve` exits non-zero, for a supervisor to
restart it).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable

from pagedlm.config import EngineConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.loop_channel import LoopChannels
from pagedlm.engine.request_prep import RequestPreparer
from pagedlm.engine.request_stream import END, RequestStream, deliver
from pagedlm.metrics.engine_view import EngineView, take_engine_view
from pagedlm.metrics.prometheus import EngineMetrics, EngineSnapshot, RequestTimes
from pagedlm.inputs.preprocess import PromptType
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams
from pagedlm.transformers_utils.tokenizer import thread_tokenizer

logger = logging.getLogger(__name__)


class AsyncEngineDeadError(RuntimeError):
    """The engine loop has stopped (it failed, or was shut down): no request can run."""


class LoRANotServedError(LookupError):
    """A request's adapter stopped being served (unloaded) while the request was prepared."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    ack: asyncio.Future
    priority: int = 0
    lora_request: object = None  # a LoRARequest
    compilation: object = None  # its grammar's, prepared on the caller's side


@dataclass
class _Abort:
    request_ids: set[str]


@dataclass
class _Call:
    """Run fn(engine, *args) on the engine thread (adapter changes); its result or error goes
    to `result`."""
    fn: object
    args: tuple
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future


_SHUTDOWN = object()


@dataclass
class _Tracked:
    """Engine-thread bookkeeping for one request: where its outputs go, and its timings."""
    stream: RequestStream
    times: RequestTimes


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():  # the caller gave up waiting (cancelled)
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class AsyncLLMEngine:

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], *, log_stats: bool = True,
                 log_stats_interval: float = 5.0, model_name: str | None = None,
                 metrics: EngineMetrics | None = None, wait: bool = True) -> None:
        """`engine`: an LLMEngine, or a function that builds one, called on the engine thread
        (raising here whatever it raised; with wait=False, from wait_built, which the caller
        must then call before anything else but shutdown, meanwhile free to do other
        start-up work). from_engine_args builds on that thread because
        libgomp keeps a worker team per thread that has run a parallel region and, once it
        manages more threads than there are CPUs, cuts its workers' spin-wait from about
        300,000 iterations to 1,000: a model loaded on one thread and stepped on another leaves
        two teams, and every kernel then waits for a sleeping worker to wake. Measured on 2
        CPUs: one gguf stream at 70 tok/s stepped on a second thread, 130 on the loading one."""
        self.log_stats = log_stats
        self.log_stats_interval = log_stats_interval
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._lock = threading.Lock()  # orders "is it dead?" against queueing a command
        self._dead: BaseException | None = None
        self._channels = LoopChannels()  # the engine thread's calls onto callers' loops
        self._tokenizer = None
        self._preparer: RequestPreparer | None = None  # built on first use
        build = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine = engine if build is None else None
        self._built = threading.Event()  # set by the engine thread once self.engine is there
        self._started = threading.Event()  # set here once the rest is: the loop may begin
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build,), name="pagedlm-engine",
                                        daemon=True)
        self._model_name, self._given_metrics = model_name, metrics
        self._thread.start()
        if wait:
            self.wait_built()

    def wait_built(self) -> None:
        """Wait until the engine thread has built the engine (raising what the build raised),
        then let its loop begin. The constructor calls it unless given wait=False."""
        if self._started.is_set():
            return
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        try:
            name = self._model_name or self.engine.config.model_config.model or "default"
            speculative = self.engine.config.speculative_config is not None
            self.metrics = (self._given_metrics if self._given_metrics is not None
                            else EngineMetrics(name, speculative=speculative))
        except BaseException:
            self._started.set()
            self.shutdown()  # no caller will ever get this engine to shut down
            raise
        self._started.set()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> "AsyncLLMEngine":
        return cls(lambda: LLMEngine.from_engine_args(args), **kwargs)

    # ---- caller side (any thread for abort/shutdown; an event loop for the rest) ----

    @property
    def errored(self) -> bool:
        return self._dead is not None and not isinstance(self._dead, AsyncEngineDeadError)

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def check_health(self) -> None:
        if not self.is_running:
            raise AsyncEngineDeadError(f"the engine loop is not running: {self._dead!r}")

    def get_tokenizer(self):
        """The tokenizer for the callers' side (the event loop's decodes): see
        thread_tokenizer for when it is the engine thread's own. Encode and decode with it
        freely; calls with truncation, padding or split_special_tokens would change it under
        the other threads."""
        if self._tokenizer is None:
            self._tokenizer = thread_tokenizer(self.engine.tokenizer)
        return self._tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_config(self):
        return self.engine.config.model_config

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    def _submit(self, command) -> None:
        with self._lock:
            if self._dead is not None:
                raise AsyncEngineDeadError(
                    f"the engine loop is not running: {self._dead!r}") from self._dead
            self._commands.put(command)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None,
                          priority: int = 0, lora_request=None,
                          lora_served: Callable[[], bool] | None = None) -> RequestStream:
        """Queue a request; returns its output stream once the engine accepted it.

        Raises the engine's ValueError for an invalid request (too long, bad params, ...).
        lora_served: whether lora_request is still served (the server's runtime unloading),
        asked last before the request is queued: unloaded while it was prepared, the engine
        loaded the adapter again from its path and kept it for good (LoRANotServedError
        instead). An unload after it queues the removal behind the request, which aborts it.
        """
        if self._preparer is None:
            self._preparer = RequestPreparer(self.engine)
        # Lists capped and tokenized, grammar compiled: off the engine thread and event loop.
        params, compilation = await self._preparer.prepare(params)
        if lora_served is not None and not lora_served():
            raise LoRANotServedError(lora_request.lora_name)
        loop = asyncio.get_running_loop()
        self._channels.register(loop)
        stream = RequestStream(request_id, loop)
        ack = loop.create_future()
        self._submit(_Add(request_id, prompt, params, arrival_time or time.time(), stream, ack,
                          priority, lora_request, compilation))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream the request's RequestOutputs (per sampling_params.output_kind)."""
        stream = await self.add_request(request_id, prompt, sampling_params,
                                        priority=priority)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:  # the consumer left early (closed, cancelled, error)
                self.abort(request_id)

    async def _on_engine_thread(self, fn, *args):
        loop = asyncio.get_running_loop()
        self._channels.register(loop)
        result = loop.create_future()
        self._submit(_Call(fn, args, loop, result))
        return await result

    async def engine_view(self) -> EngineView:
        """Queues, KV block map and counters, taken on the engine thread between steps."""
        return await self._on_engine_thread(lambda e: take_engine_view(e.scheduler, e.stats))

    async def add_lora(self, lora_request) -> bool:
        """Register and load an adapter (LLMEngine.add_lora: ValueError for a bad one)."""
        return await self._on_engine_thread(LLMEngine.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._on_engine_thread(LLMEngine.remove_lora, lora_id)

    async def list_loras(self) -> list:
        return await self._on_engine_thread(LLMEngine.list_loras)

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Safe from any thread."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        if not ids:
            return
        try:
            self._submit(_Abort(ids))
        except AsyncEngineDeadError:
            pass  # nothing runs any more

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests still in flight fail with AsyncEngineDeadError.
        Before wait_built (wait=False) it waits for the build to end, then shuts down the
        engine built."""
        with self._lock:
            if self._dead is None:
                self._commands.put(_SHUTDOWN)
        self._started.set()  # a loop not yet begun begins, to read the shutdown
        self._thread.join(timeout)
        if self._preparer is not None:
            self._preparer.shutdown()
        if self.engine is None:  # its build failed (or outlasted the timeout)
            return
        self._shutdown_engine()  # done already by the engine thread, unless it was stuck

    def _shutdown_engine(self) -> None:
        try:
            self.engine.shutdown()  # stop worker processes, if any
        except Exception:
            if not self.errored:
                raise
            # A failed engine may fail again on its way down (a trace file on a full disk):
            # the cause is logged already, and the workers must stop all the same.
            logger.debug("the failed engine did not shut down cleanly", exc_info=True)
            self.engine.executor.shutdown()

    # ---- engine thread ----

    def _run(self, build: Callable[[], LLMEngine] | None) -> None:
        if build is not None:
            try:
                self.engine = build()
            except BaseException as e:  # noqa: BLE001 - re-raised on the constructing thread
                self._build_error = e
        self._built.set()
        if self._build_error is not None:
            return
        self._started.wait()
        try:
            while True:
                if not self._process_commands(block=not self.engine.has_unfinished_requests()):
                    self._stop(AsyncEngineDeadError("the engine was shut down"))
                    # On this thread, which built it: Ray's head processes die with the thread
                    # that started them, and the executor's shutdown after this thread's exit
                    # waited 60 s for Ray's GCS to answer (Ctrl-C on a Ray server: 61 s, exit 1).
                    # An error here (a trace file on a full disk) is the caller's: shutdown()
                    # runs it again on its thread, where it is raised.
                    try:
                        self._shutdown_engine()
                    except Exception:  # noqa: BLE001
                        logger.debug("the engine did not shut down on its thread", exc_info=True)
                    return
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                else:  # idle (a step finds a dead worker by itself): at least once a second
                    self.engine.executor.check_health()
                self._publish_stats()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the callers
            # The one place the cause is logged: the executor only raises it, and the server
            # only says that it stops because of it.
            logger.exception("engine loop failed; failing all in-flight requests")
            self._stop(e)

    def _process_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False on shutdown."""
        try:
            timeout = max(0.1, min(1.0, self.log_stats_interval))
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _SHUTDOWN:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                self._run_call(command)
            else:
                self._abort(command.request_ids)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, cmd: _Add) -> None:
        error = None
        try:
            with contextlib.ExitStack() as stack:
                if cmd.compilation is not None:
                    stack.enter_context(self.engine.structured_output.adopted(
                        cmd.params.structured_outputs, cmd.compilation))
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                        cmd.arrival_time, priority=cmd.priority,
                                        lora_request=cmd.lora_request)
        except Exception as e:  # noqa: BLE001 - a bad request fails itself, not the loop
            error = e
        else:
            self._tracked[cmd.request_id] = _Tracked(
                cmd.stream, RequestTimes(cmd.params.output_kind, cmd.arrival_time))
        self._call(cmd.stream.loop, _resolve, cmd.ack, error)

    def _run_call(self, cmd: _Call) -> None:
        def settle(fut: asyncio.Future, value, error) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)

        value = error = None
        try:
            value = cmd.fn(self.engine, *cmd.args)
        except Exception as e:  # noqa: BLE001 - a bad adapter fails its caller, not the loop
            error = e
        # Requests an unload aborted in the engine: end their streams too.
        for rid in [r for r in self._tracked if r not in self.engine.requests]:
            self._abort_stream(rid)
        self._call(cmd.loop, settle, cmd.result, value, error)

    def _abort_stream(self, rid: str) -> None:
        tracked = self._tracked.pop(rid)
        self.metrics.record_finished("abort")
        self._call(tracked.stream.loop, deliver, [(tracked.stream, END)])

    def _abort(self, ids: set[str]) -> None:
        present = [rid for rid in ids if rid in self._tracked]
        if not present:
            return
        self.engine.abort_request(present)
        by_loop = defaultdict(list)
        for rid in present:
            tracked = self._tracked.pop(rid)
            self.metrics.record_finished("abort")
            by_loop[tracked.stream.loop].append((tracked.stream, END))
        for loop, items in by_loop.items():
            self._call(loop, deliver, items)
        logger.debug("aborted %d request(s)", len(present))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        by_loop = defaultdict(list)
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            self.metrics.observe(tracked.times, out, now)
            if out.finished:
                del self._tracked[out.request_id]
            by_loop[tracked.stream.loop].append((tracked.stream, out))
        for loop, items in by_loop.items():
            self._call(loop, deliver, items)

    def _publish_stats(self) -> None:
        e = self.engine
        self.metrics.update(EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_swapped=len(e.scheduler.swapped), kv_cache_usage=e.block_manager.usage(),
            prefix_cache_hit_rate=e.prefix_cache_hit_rate,
            prompt_tokens=e.stats.num_prompt_tokens,
            generation_tokens=e.stats.num_generation_tokens,
            preemptions=e.stats.num_preemptions,
            running_loras=e.running_loras() if e.config.lora_config else [],
            max_loras=e.config.lora_config.max_loras if e.config.lora_config else 0,
            spec_decode=e.stats.spec_decode))
        if self.log_stats:
            self.metrics.maybe_log(self.log_stats_interval)

    def _call(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        # Not loop.call_soon_threadsafe: its wake-up gives the GIL to the loop thread in the
        # middle of the engine's step (engine/loop_channel.py).
        self._channels.call(loop, fn, *args)

    def _stop(self, error: BaseException) -> None:
        """Mark the engine dead and fail everything in flight or still queued with `error`."""
        with self._lock:
            self._dead = error
        by_loop = defaultdict(list)
        for tracked in self._tracked.values():
            by_loop[tracked.stream.loop].append((tracked.stream, error))
        ids = list(self._tracked)
        self._tracked.clear()
        while True:  # commands queued before we were marked dead
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._call(command.stream.loop, _resolve, command.ack,
                           AsyncEngineDeadError(f"the engine loop is not running: {error!r}"))
            elif isinstance(command, _Call):  # e.g. an engine view: its caller must not hang
                self._call(command.loop, _resolve, command.result,
                           AsyncEngineDeadError(f"the engine loop is not running: {error!r}"))
        try:  # free the KV blocks of whatever was running, if the engine still can
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001
            logger.debug("could not abort requests after the engine loop stopped",
                         exc_info=True)
        for loop, items in by_loop.items():  # last: callers see the engine already cleaned up
            self._call(loop, deliver, items)
