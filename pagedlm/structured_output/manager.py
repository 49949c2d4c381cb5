"""The engine's side of structured outputs: check and compile off the step loop, match, fill
bitmasks.

A new spec goes through two stages, each on its own low-priority thread: the check compiles it
in a child process that is killed past the compile time limit (sandbox.py), then the compile
builds the grammar in this process. prepare() starts them from any thread (the async engine
calls it on the caller's side and awaits the grammar before the request reaches the engine
thread); register() on the engine thread finds the result, or (offline, LLMEngine used directly)
waits for the check alone, so that a bad spec is a ValueError from add_request and the request
waits in the scheduler only for the compile.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import torch

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.backend import CompiledGrammar, StructuredOutputBackend
from pagedlm.structured_output.bitmask import GrammarBitmask, bitmask_width
from pagedlm.structured_output.registry import backend_class, check_backend
from pagedlm.structured_output.request import StructuredOutputRequest
from pagedlm.structured_output.sandbox import GrammarSandbox
from pagedlm.utils import ctrl_c_deferred, lower_thread_priority

logger = logging.getLogger(__name__)

# Distinct specs whose compilations are kept (failed ones too: a spec that timed out is refused
# again at once); a JSON schema's grammar takes 0.1 to 10 MB.
_CACHE_SIZE = 256


def _new_future() -> Future:
    # Running from the start: a caller that gives up waiting cannot cancel a compilation that
    # other requests share.
    fut: Future = Future()
    fut.set_running_or_notify_cancel()
    return fut


@dataclass(eq=False)
class Compilation:
    """One spec's way to its grammar. `checked`: it compiled in the sandbox within the time
    limit (or its ValueError); `grammar`: compiled here (or the same error)."""
    checked: Future = field(default_factory=_new_future)
    grammar: Future = field(default_factory=_new_future)
    # Callers of prepare() that have not released it (the manager's lock guards it). A spec
    # whose check has not started when this falls to 0 is not compiled: its clients left.
    waiters: int = 0

    @property
    def failed_for_the_server(self) -> bool:
        """Failed for a reason other than the spec (the sandbox could not start, shutdown):
        not kept, so that the spec is tried again."""
        return (self.grammar.done() and self.grammar.exception() is not None
                and not isinstance(self.grammar.exception(), ValueError))


class StructuredOutputManager:

    def __init__(self, backend: str, tokenizer, vocab_size: int,
                 eos_token_ids: frozenset[int], compile_timeout: float = 10.0) -> None:
        check_backend(backend)
        self._backend_name = backend
        self._backend_args = (tokenizer, vocab_size, eos_token_ids)
        self._backend: StructuredOutputBackend | None = None
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        # prepare() runs on callers' threads, register() on the engine thread.
        self._lock = threading.RLock()
        self._backend_lock = threading.Lock()  # held while the backend is built (a second)
        self._check_pool: ThreadPoolExecutor | None = None
        self._compile_pool: ThreadPoolExecutor | None = None
        self._sandbox: GrammarSandbox | None = None
        self._compilations: OrderedDict[tuple, Compilation] = OrderedDict()
        self._unfinished: set[Compilation] = set()  # failed at shutdown, so none waits forever
        self._adopted: dict[tuple, Compilation] = {}  # engine thread: see adopted()
        self._pending: list[tuple[str, StructuredOutputRequest]] = []  # (request id, ...)
        self._closed = False

    @property
    def backend_cls(self) -> type[StructuredOutputBackend]:
        # Imported at the first structured-output request (on the request-preparing thread),
        # not at engine start-up.
        return backend_class(self._backend_name)

    @property
    def backend(self) -> StructuredOutputBackend:
        # Built on first use, on the check or compile thread: the tokenizer's vocabulary scan
        # takes a while and must not hold up the step loop.
        with self._backend_lock:
            if self._backend is None:
                self._backend = self.backend_cls(*self._backend_args)
            return self._backend

    def prepare(self, params: StructuredOutputsParams) -> Compilation:
        """The spec's compilation: found, or started; the caller waits for it until it calls
        release(). Thread-safe; ValueError at once for a spec the backend never takes (the
        size bounds were checked when params was built)."""
        key = params.cache_key()
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shutting down")
            found = self._compilations.get(key)
            if found is not None and not found.failed_for_the_server:
                self._compilations.move_to_end(key)
                found.waiters += 1
                return found
            self.backend_cls.validate(params)
            # Cached and submitted, or neither: a Ctrl-C between left a compilation nothing
            # would ever finish, and every later request with the spec waited on it for good.
            with ctrl_c_deferred():
                if self._check_pool is None:
                    # One thread each: specs queue behind each other, never behind the step
                    # loop, and at most one is compiled in each place at a time.
                    self._check_pool = ThreadPoolExecutor(1, "pagedlm-grammar-check",
                                                          initializer=lower_thread_priority)
                    self._compile_pool = ThreadPoolExecutor(1, "pagedlm-grammar",
                                                            initializer=lower_thread_priority)
                comp = Compilation(waiters=1)
                self._compilations[key] = comp
                while len(self._compilations) > _CACHE_SIZE:
                    self._compilations.popitem(last=False)
                self._unfinished.add(comp)
                comp.grammar.add_done_callback(lambda _: self._finished(comp))
                self._check_pool.submit(self._check, params, comp)
        return comp

    def release(self, comp: Compilation) -> None:
        """The caller of prepare() no longer waits for comp (it has it, or gave up)."""
        with self._lock:
            comp.waiters -= 1

    def _finished(self, comp: Compilation) -> None:
        with self._lock:
            self._unfinished.discard(comp)

    def _check(self, params: StructuredOutputsParams, comp: Compilation) -> None:
        # Specs are checked one at a time, each up to the compile time limit: one whose
        # clients all left while it queued is dropped, not compiled for nobody (five slow
        # regexes whose clients gave up after 1.5 s held a later request 18 s).
        with self._lock:
            abandoned = comp.waiters <= 0
            if abandoned and self._compilations.get(params.cache_key()) is comp:
                del self._compilations[params.cache_key()]
        if abandoned:
            logger.debug("%s: no request waits for it any more; not compiled",
                         params.field_name)
            _fail(comp, RuntimeError("the grammar was not compiled: no request waited for it"))
            return
        try:
            if self._sandbox is None:
                self._sandbox = GrammarSandbox(self.backend_cls.name,
                                               lambda: self.backend.sandbox_state(),
                                               self.compile_timeout)
            seconds = self._sandbox.check(params)
        except BaseException as e:  # noqa: BLE001 - every failure reaches the request
            _fail(comp, e)
            return
        logger.debug("%s compiled in the sandbox in %.3fs", params.field_name, seconds)
        comp.checked.set_result(None)
        try:
            self._compile_pool.submit(self._compile_into, params, comp)
        except RuntimeError as e:  # shut down meanwhile
            _fail(comp, e)

    def _compile_into(self, params: StructuredOutputsParams, comp: Compilation) -> None:
        try:
            grammar = self._compile(params)
        except BaseException as e:  # noqa: BLE001
            _fail(comp, e)
        else:
            _settle(comp.grammar, grammar)

    @contextlib.contextmanager
    def adopted(self, params: StructuredOutputsParams, comp: Compilation) -> Iterator[None]:
        """On the engine thread, around add_request: register() takes `comp` for params
        (prepared on the caller's side), even if the cache has dropped it meanwhile."""
        key = params.cache_key()
        self._adopted[key] = comp
        try:
            yield
        finally:
            self._adopted.pop(key, None)

    def register(self, request_id: str, params: StructuredOutputsParams
                 ) -> StructuredOutputRequest:
        """The request's grammar, compiled or compiling; ValueError naming the field for a spec
        that does not compile (within the time limit). Waits for the sandbox's verdict unless
        the spec was prepared: only LLMEngine's own callers (offline) wait here."""
        comp = self._adopted.get(params.cache_key())
        if comp is None:
            comp = self.prepare(params)
            try:
                comp.checked.result()  # raises the spec's error
            finally:
                self.release(comp)
        request = StructuredOutputRequest(params, comp.grammar)
        if not comp.grammar.done():
            self._pending.append((request_id, request))
        return request

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return self.backend.compile(params)

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """Requests whose compilation has failed since the last call (the engine aborts them)."""
        if not self._pending:
            return []
        failed = [(rid, r.error) for rid, r in self._pending if r.error is not None]
        self._pending = [(rid, r) for rid, r in self._pending if not r._grammar.done()]
        return failed

    def wait_for_pending(self, timeout: float) -> None:
        """Block until some compilation finishes (or timeout): for a step with nothing else to
        run, instead of spinning."""
        futures = [r._grammar for _, r in self._pending]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    @property
    def has_pending(self) -> bool:
        return any(not r._grammar.done() for _, r in self._pending)

    def grammar_bitmask(self, scheduled_groups) -> GrammarBitmask | None:
        """The step's bitmask: one row per sample of a sequence that has a grammar, in the order
        the runner lays out samples (scheduled groups, their sequences, num_samples each)."""
        rows, matchers, first_rows, forks = [], [], [], []
        row = 0
        for sg in scheduled_groups:
            so = sg.group.structured_output
            for seq, k in zip(sg.seqs, sg.num_samples):
                if k and so is not None:
                    rows.extend(range(row, row + k))
                    matchers.append(so.matcher(seq))
                    first_rows.append(row)
                    if k > 1:
                        forks.append((row, k))
                row += k
        if not matchers:
            return None
        bitmask = torch.full((row, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        self.backend.fill_bitmask(matchers, bitmask, first_rows)
        for r, k in forks:  # a prompt forking into k samples: its row for each of them
            bitmask[r + 1:r + k] = bitmask[r]
        return GrammarBitmask(rows, bitmask, self.vocab_size)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            unfinished = list(self._unfinished)
        for pool in (self._check_pool, self._compile_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()
        for comp in unfinished:  # queued ones were cancelled: their waiters must not hang
            _fail(comp, RuntimeError("the engine shut down before the grammar was compiled"))


def _settle(fut: Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _fail(comp: Compilation, error: BaseException) -> None:
    for fut in (comp.checked, comp.grammar):
        if not fut.done():
            try:
                fut.set_exception(error)
            except cf.InvalidStateError:  # settled by another thread meanwhile
                pass
