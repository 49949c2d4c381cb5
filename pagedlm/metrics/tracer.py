"""StepTracer: what the engine did in each step, for people studying how serving works.

`LLM(..., trace_file="run.json")` (or `--trace-file run.json`) records, per step: the scheduled
sequences with their token counts (prefill chunk or decode), the token budget used, preemptions
(recompute or swap) and swaps in, prefix-cache hits, block allocations, frees, copy-on-write
copies and evictions, the queues, the KV block map, speculative decoding's lookahead per
sequence and drafts verified and accepted, and the step's time split. On shutdown it
writes `run.json` (Chrome trace-event JSON: open it in https://ui.perfetto.dev or
chrome://tracing) and `run.steps.jsonl` (one meta line, then one StepRecord per line), each
atomically (temp file + rename). `pagedlm trace run.steps.jsonl -o DIR` renders them
(pagedlm/metrics/trace_render.py).

The engine holds the tracer (no global state) as one of its step observers (metrics/stats.py);
when tracing is off there is none and nothing else runs. When on, the block pools are
TracedBlockPools (counters around the plain pool's operations) and each step costs a scan of the
queues and of the block reference counts (the block map).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlm.core.block_pool import BlockPool
from pagedlm.metrics.stats import (
    FinishedStep,
    ScheduledStep,
    SpecDecodeCounts,
    StepObserver,
    StepTimes,
)

if TYPE_CHECKING:
    from pagedlm.core.block_manager import BlockManager
    from pagedlm.core.scheduler import Scheduler
    from pagedlm.core.scheduler_output import SchedulerOutput

# One character per KV block in StepRecord.block_map.
FREE, USED, SHARED, CACHED = ".", "u", "s", "c"
BLOCK_STATES = {FREE: "free", USED: "used", SHARED: "shared", CACHED: "cached"}


@dataclass
class BlockOps:
    """Block pool operations since the previous record (one pool: device or host)."""
    allocated: int = 0  # blocks taken from the free lists (evictions included)
    freed: int = 0  # references dropped to zero
    revived: int = 0  # free cached blocks taken back by a prefix-cache hit
    shared: int = 0  # extra references to a used block (forks, prefix hits on used blocks)
    evicted: int = 0  # allocations that had to drop a cached block

    def any(self) -> bool:
        return bool(self.allocated or self.freed or self.revived or self.shared or self.evicted)


@dataclass
class ScheduledSeq:
    request_id: str
    seq_id: int
    kind: str  # "prefill" (a prompt chunk, or recomputation) or "decode" (one new token)
    num_tokens: int
    num_computed_tokens: int  # before this step (a prefix-cache hit included)
    lookahead: int = 0  # speculative decoding: slots reserved for drafts past its new token


@dataclass
class Preemption:
    request_id: str
    mode: str  # "recompute" or "swap"


@dataclass
class StepRecord:
    step: int
    start: float  # seconds since the tracer started
    duration: float
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0  # as the scheduler reported it
    token_budget: int = 0
    preempted: list[Preemption] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # finished unscheduled (could never fit)
    finished: list[str] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    device: BlockOps = field(default_factory=BlockOps)
    cpu: BlockOps = field(default_factory=BlockOps)
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    block_map: str = ""  # after the step, one of FREE/USED/SHARED/CACHED per device block
    times: StepTimes = field(default_factory=StepTimes)
    # Speculative decoding in this step: drafts verified, accepted, and sequences verifying.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0


@dataclass
class TraceMeta:
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    token_budget: int
    max_num_seqs: int
    preemption_mode: str
    model: str | None


class TracedBlockPool(BlockPool):
    """A BlockPool that counts its operations into the tracer's pending BlockOps."""

    def __init__(self, tracer: "StepTracer", pool: str, num_blocks: int,
                 enable_caching: bool = False) -> None:
        super().__init__(num_blocks, enable_caching)
        self._tracer = tracer
        self._pool = pool  # "device" or "cpu": its key in the records

    def _ops(self) -> BlockOps:
        return self._tracer.pending[self._pool]

    def take(self) -> int:
        evictions = self.num_evictions
        block_id = super().take()
        ops = self._ops()
        ops.allocated += 1
        ops.evicted += self.num_evictions - evictions
        return block_id

    def share(self, block_id: int) -> None:
        ops = self._ops()
        if self.ref_counts[block_id] == 0:
            ops.revived += 1
        else:
            ops.shared += 1
        super().share(block_id)

    def release(self, block_id: int) -> None:
        super().release(block_id)
        if self.ref_counts[block_id] == 0:
            self._ops().freed += 1


def block_map(pool: BlockPool) -> str:
    """One character per block: free, used (one reference), shared (several), or cached (free
    but still findable by a prefix-cache lookup)."""
    hashes = pool.block_hash
    return "".join(USED if r == 1 else SHARED if r > 1 else CACHED if hashes[i] is not None
                   else FREE for i, r in enumerate(pool.ref_counts))


def records_path(trace_file: str) -> str:
    """Where the raw step records of `trace_file` (the Chrome JSON) go."""
    root, ext = os.path.splitext(trace_file)
    return (root if ext == ".json" else trace_file) + ".steps.jsonl"


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        write(f)
    os.replace(tmp, path)


class StepTracer(StepObserver):

    def __init__(self, trace_file: str) -> None:
        if not isinstance(trace_file, (str, os.PathLike)) or not str(trace_file):
            raise ValueError(f"trace_file must be a file path, got {trace_file!r}.")
        self.trace_file = os.fspath(trace_file)
        parent = os.path.dirname(os.path.abspath(self.trace_file))
        if not os.path.isdir(parent):
            raise ValueError(f"trace_file {self.trace_file!r}: directory {parent!r} does not "
                             f"exist.")
        self.records_file = records_path(self.trace_file)
        # Records stream to a temp file (memory stays flat on long runs); close() renames it.
        self._tmp_records = f"{self.records_file}.tmp-{os.getpid()}"
        self._out = open(self._tmp_records, "w")
        self.pending = {"device": BlockOps(), "cpu": BlockOps()}
        self.num_steps = 0
        self.t0 = time.perf_counter()
        self.meta: TraceMeta | None = None
        self.closed = False
        # Between the hooks of one step: the queues and prefix hits before scheduling, and the
        # step's record (None when nothing ran).
        self._before: tuple[set[int], set[int]] = (set(), set())
        self._prefix_hits = 0
        self._spec = SpecDecodeCounts()
        self._record: StepRecord | None = None
        # An engine nobody shut down is otherwise closed by LLM.__del__ during interpreter
        # teardown, when builtins such as open() are already gone.
        atexit.register(self.close)

    def block_pool(self, pool: str, num_blocks: int, enable_caching: bool = False) -> BlockPool:
        """The BlockManager's pool factory (core/block_pool.py's PoolFactory)."""
        return TracedBlockPool(self, pool, num_blocks, enable_caching)

    def start(self, meta: TraceMeta) -> None:
        self.meta = meta
        self._out.write(json.dumps({"type": "meta", **dataclasses.asdict(meta)}) + "\n")

    # -- one step: the engine's StepObserver hooks -----------------------------------------------
    def step_begins(self, scheduler: "Scheduler") -> None:
        self._before = self.queues_before(scheduler)
        self._prefix_hits = scheduler.block_manager.prefix_hits
        self._spec = SpecDecodeCounts.of(scheduler.stats)

    def step_scheduled(self, step: ScheduledStep) -> None:
        hits = step.scheduler.block_manager.prefix_hits - self._prefix_hits
        rec = self.scheduled(step.start, step.output, step.scheduler, self._before, hits)
        # Nothing ran: no record.
        self._record = None if step.output.is_empty and not rec.preempted else rec

    def step_finished(self, step: FinishedStep) -> None:
        if self._record is not None:
            spec = SpecDecodeCounts.of(step.scheduler.stats) - self._spec
            self._record.spec_draft_tokens = spec.num_draft_tokens
            self._record.spec_accepted_tokens = spec.num_accepted_tokens
            self._record.spec_drafts = spec.num_drafts
            self.finish(self._record, step.output, step.scheduler.block_manager, step.end,
                        step.times)
            self._record = None

    def engine_stops(self, scheduler: "Scheduler") -> None:
        self.close(scheduler.block_manager)

    @staticmethod
    def queues_before(scheduler: "Scheduler") -> tuple[set[int], set[int]]:
        return {id(g) for g in scheduler.running}, {id(g) for g in scheduler.swapped}

    def scheduled(self, t_start: float, sched: "SchedulerOutput", scheduler: "Scheduler",
                  before: tuple[set[int], set[int]], prefix_hits: int) -> StepRecord:
        """The record of a step just scheduled (its sequences' counts are still pre-step)."""
        from pagedlm.model_io import is_decode  # the engine's own prefill/decode rule

        running, swapped = before
        rec = StepRecord(step=self.num_steps, start=t_start - self.t0, duration=0.0,
                         num_batched_tokens=sched.num_batched_tokens,
                         token_budget=scheduler.config.max_num_batched_tokens,
                         prefix_hit_tokens=prefix_hits, cow_copies=len(sched.blocks_to_copy),
                         blocks_swapped_out=len(sched.blocks_to_swap_out),
                         blocks_swapped_in=len(sched.blocks_to_swap_in),
                         running=sched.running_queue_size, waiting=sched.waiting_queue_size,
                         swapped=sched.swapped_queue_size,
                         ignored=[g.request_id for g in sched.ignored_groups])
        for sg in sched.scheduled_groups:
            rid = sg.group.request_id
            for s, n, k in zip(sg.seqs, sg.num_new_tokens, sg.num_lookahead):
                kind = "decode" if is_decode(s.num_computed_tokens, n) else "prefill"
                rec.scheduled.append(ScheduledSeq(rid, s.seq_id, kind, n, s.num_computed_tokens,
                                                  k))
            if id(sg.group) in swapped:
                rec.swapped_in.append(rid)
        rec.preempted = ([Preemption(g.request_id, "recompute") for g in scheduler.waiting
                          if id(g) in running]
                         + [Preemption(g.request_id, "swap") for g in scheduler.swapped
                            if id(g) in running])
        return rec

    def finish(self, rec: StepRecord, sched: "SchedulerOutput", block_manager: "BlockManager",
               t_end: float, times: StepTimes) -> None:
        rec.duration = t_end - self.t0 - rec.start
        rec.times = times
        self.num_steps += 1
        rec.finished = [sg.group.request_id for sg in sched.scheduled_groups
                        if sg.group.is_finished()]
        self._emit(rec, block_manager)

    def _emit(self, rec: StepRecord, block_manager: "BlockManager") -> None:
        rec.device, rec.cpu = self.pending["device"], self.pending["cpu"]
        self.pending = {"device": BlockOps(), "cpu": BlockOps()}
        rec.block_map = block_map(block_manager.device)
        self._out.write(json.dumps(dataclasses.asdict(rec), separators=(",", ":")) + "\n")

    # -- the end --------------------------------------------------------------------------------
    def close(self, block_manager: "BlockManager | None" = None) -> None:
        """Write both files (idempotent). Block operations after the last step (aborts) go in a
        last record with nothing scheduled, so the counts still add up."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if block_manager is not None and (self.pending["device"].any()
                                          or self.pending["cpu"].any()):
            now = time.perf_counter() - self.t0
            self._emit(StepRecord(step=self.num_steps, start=now, duration=0.0),
                       block_manager)
        self._out.close()
        meta, steps = load_records(self._tmp_records)
        _atomic_write(self.trace_file,
                      lambda f: json.dump(chrome_trace(meta, steps), f, separators=(",", ":")))
        os.replace(self._tmp_records, self.records_file)


def load_records(path: str) -> tuple[dict, list[dict]]:
    """(meta, step records) of a .steps.jsonl file, as plain dicts."""
    meta, steps = {}, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:  # a line cut short by a crash, say
                raise ValueError(f"{path}:{n}: not a JSON record: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: a record must be a JSON object, got "
                                 f"{type(obj).__name__}.")
            if obj.get("type") == "meta":
                meta = obj
            else:
                steps.append(obj)
    return meta, steps


def chrome_trace(meta: dict, steps: list[dict]) -> dict:
    """Chrome trace-event JSON: the engine's steps and their phases on one track, each request
    on a track of its own (its prefill chunks and decodes, preemptions as instant events), and
    counters for the KV blocks, queues and tokens per step."""
    us = 1e6
    events: list[dict] = [
        {"ph": "M", "pid": 1, "tid": 0, "name": "process_name", "args": {"name": "engine"}},
        {"ph": "M", "pid": 1, "tid": 0, "name": "thread_name", "args": {"name": "steps"}},
        {"ph": "M", "pid": 2, "tid": 0, "name": "process_name", "args": {"name": "requests"}},
    ]
    tids: dict[str, int] = {}
    # A counter track for speculative decoding only in runs that drafted (records written
    # before it existed lack the fields).
    speculative = any(s.get("spec_draft_tokens") for s in steps)

    def tid(rid: str) -> int:
        if rid not in tids:
            tids[rid] = len(tids) + 1
            events.append({"ph": "M", "pid": 2, "tid": tids[rid], "name": "thread_name",
                           "args": {"name": rid}})
        return tids[rid]

    for s in steps:
        ts, times = s["start"] * us, s["times"]
        prefill = sum(x["num_tokens"] for x in s["scheduled"] if x["kind"] == "prefill")
        decode = sum(x["num_tokens"] for x in s["scheduled"] if x["kind"] == "decode")
        events.append({"ph": "X", "pid": 1, "tid": 0, "ts": ts, "dur": s["duration"] * us,
                       "name": f"step {s['step']}", "cat": "step",
                       "args": {"tokens": s["num_batched_tokens"], "budget": s["token_budget"],
                                "prefill_tokens": prefill, "decode_tokens": decode,
                                "cow_copies": s["cow_copies"],
                                "device_blocks": s["device"],
                                "draft_tokens": s.get("spec_draft_tokens", 0),
                                "accepted_tokens": s.get("spec_accepted_tokens", 0)}})
        t = ts
        for phase in ("schedule", "prepare", "forward", "sample", "output"):
            d = max(0.0, times[phase]) * us
            events.append({"ph": "X", "pid": 1, "tid": 0, "ts": t, "dur": d, "name": phase,
                           "cat": "phase"})
            t += d
        for x in s["scheduled"]:
            events.append({"ph": "X", "pid": 2, "tid": tid(x["request_id"]), "ts": ts,
                           "dur": s["duration"] * us, "name": x["kind"], "cat": x["kind"],
                           "args": {"seq_id": x["seq_id"], "tokens": x["num_tokens"],
                                    "computed_before": x["num_computed_tokens"],
                                    "lookahead": x.get("lookahead", 0)}})
        for p in s["preempted"]:
            events.append({"ph": "i", "s": "t", "pid": 2, "tid": tid(p["request_id"]), "ts": ts,
                           "name": f"preempted ({p['mode']})", "cat": "preemption"})
        for rid in s["swapped_in"]:
            events.append({"ph": "i", "s": "t", "pid": 2, "tid": tid(rid), "ts": ts,
                           "name": "swapped in", "cat": "swap"})
        bm = s["block_map"]
        events += [
            {"ph": "C", "pid": 1, "tid": 0, "ts": ts, "name": "KV blocks",
             "args": {BLOCK_STATES[c]: bm.count(c) for c in BLOCK_STATES}},
            {"ph": "C", "pid": 1, "tid": 0, "ts": ts, "name": "queues",
             "args": {"running": s["running"], "waiting": s["waiting"],
                      "swapped": s["swapped"]}},
            {"ph": "C", "pid": 1, "tid": 0, "ts": ts, "name": "tokens",
             "args": {"prefill": prefill, "decode": decode}},
        ]
        if speculative:
            events.append({"ph": "C", "pid": 1, "tid": 0, "ts": ts, "name": "speculation",
                           "args": {"drafted": s.get("spec_draft_tokens", 0),
                                    "accepted": s.get("spec_accepted_tokens", 0)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {k: v for k, v in meta.items() if k != "type"}}
