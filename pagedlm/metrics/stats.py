"""What the engine counts, and what it tells its step observers.

EngineStats: totals since start-up, kept by LLMEngine and read by the metrics, the engine view
and the benchmarks. StepObserver: hooks the engine calls around every step with typed data, so
that a watcher (the step tracer) needs no step loop of its own. With no observer registered a
step costs two checks of an empty list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedlm.core.scheduler_output import SchedulerStats

if TYPE_CHECKING:
    from pagedlm.core.scheduler import Scheduler
    from pagedlm.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's totals since start-up, or their change over an interval."""
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_drafts: int = 0  # sequence-steps that verified at least one draft (vLLM's "drafts")

    @classmethod
    def of(cls, stats: SchedulerStats) -> SpecDecodeCounts:
        return cls(stats.spec_num_drafts, stats.spec_num_accepted, stats.spec_num_verifies)

    def __sub__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_draft_tokens - other.num_draft_tokens,
                                self.num_accepted_tokens - other.num_accepted_tokens,
                                self.num_drafts - other.num_drafts)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying sequence-step emits: its accepted drafts and the one after them
        (vLLM's mean acceptance length; 0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        return (f"Mean acceptance length: {self.mean_acceptance_length:.2f}, Accepted: "
                f"{self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Draft acceptance rate: {100 * self.acceptance_rate:.1f}%")


@dataclass
class EngineStats:
    scheduler: SchedulerStats  # preemptions, swaps and ignored groups: kept there only
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (recomputation included)
    num_generation_tokens: int = 0
    step_time: float = 0.0  # whole step() wall time
    model_time: float = 0.0  # inside the executor: the three below, block copies, and IPC
    prepare_time: float = 0.0  # building the flat batch (the output rank's)
    forward_time: float = 0.0  # model forward and logits, communication included
    sample_time: float = 0.0  # sampler
    comm_time: float = 0.0  # of forward: the output rank's collectives and stage transfers

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_swapped_out(self) -> int:
        return self.scheduler.num_swapped_out

    @property
    def num_swapped_in(self) -> int:
        return self.scheduler.num_swapped_in

    @property
    def num_ignored(self) -> int:
        return self.scheduler.num_ignored

    @property
    def spec_decode(self) -> SpecDecodeCounts:
        return SpecDecodeCounts.of(self.scheduler)

    def model_times(self) -> tuple[float, float, float]:
        """(prepare, forward, sample) so far: an observer's step takes the differences."""
        return self.prepare_time, self.forward_time, self.sample_time

    def breakdown(self) -> str:
        rest = self.step_time - self.model_time
        parts = [("forward", self.forward_time - self.comm_time), ("sampling", self.sample_time),
                 ("input prep", self.prepare_time),
                 ("scheduler + output processing", rest)]
        if self.comm_time:  # several workers: what crossing between them costs
            ipc = self.model_time - self.prepare_time - self.forward_time - self.sample_time
            parts[1:1] = [("collectives", self.comm_time), ("executor IPC + waiting", ipc)]
        total = self.step_time or 1e-9
        return (f"{self.num_steps} steps, {self.step_time:.1f}s: " + ", ".join(
            f"{name} {t:.1f}s ({100 * t / total:.1f}%)" for name, t in parts))


@dataclass
class StepTimes:
    """Seconds: schedule, then the executor's prepare / forward / sample, then output (the
    output processing, scheduler update and executor overhead: step time less the rest)."""
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    output: float = 0.0


@dataclass
class ScheduledStep:
    """A step just scheduled, not yet run: its sequences' counts are still pre-step."""
    start: float  # time.perf_counter() when step() began
    scheduled: float  # when schedule() returned
    output: "SchedulerOutput"
    scheduler: "Scheduler"


@dataclass
class FinishedStep:
    """A step after its outputs were processed."""
    output: "SchedulerOutput"
    scheduler: "Scheduler"
    end: float  # time.perf_counter()
    times: StepTimes


class StepObserver:
    """Hooks around each LLMEngine step; each does nothing unless overridden. They run on the
    engine's thread, in the step: what they cost, every step pays."""

    def step_begins(self, scheduler: "Scheduler") -> None:
        """Before scheduling (the queues as the previous step and the adds/aborts left them)."""

    def step_scheduled(self, step: ScheduledStep) -> None:
        pass

    def step_finished(self, step: FinishedStep) -> None:
        pass

    def engine_stops(self, scheduler: "Scheduler") -> None:
        """At shutdown (after any aborts following the last step)."""
