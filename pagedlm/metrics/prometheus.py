"""Serving metrics: Prometheus gauges, counters and histograms, and the periodic stats log line.

One EngineMetrics per AsyncLLMEngine, each with its own CollectorRegistry (no global state), so
several engines (or test servers) in one process do not collide. Only the engine thread records;
prometheus_client's metric objects are thread-safe, so /metrics can be scraped from any thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, GCCollector, Gauge, Histogram

from pagedlm.metrics.stats import SpecDecodeCounts
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0)


@dataclass
class EngineSnapshot:
    """Totals the engine thread publishes after each step (read by the stats log)."""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    running_loras: list[str] = field(default_factory=list)  # adapters of running requests
    max_loras: int = 0
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)


@dataclass
class RequestTimes:
    """One request's latency bookkeeping between its outputs (kept on the engine thread)."""
    kind: RequestOutputKind
    arrival_time: float
    last_output_time: float | None = None
    tokens: dict[int, int] = field(default_factory=dict)  # completion index -> tokens so far
    ttft_recorded: bool = False


class EngineMetrics:

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 speculative: bool = False) -> None:
        """speculative: the engine has speculative decoding (its metrics are there then)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        # python_gc_*, as prometheus_client's default registry (vLLM's /metrics) has them: the
        # collector's passes, which `pagedlm serve` keeps off until it is built (cli.main).
        GCCollector(registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("pagedlm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("pagedlm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("pagedlm:num_requests_swapped",
                             "Requests preempted to the host swap pool.")
        self.kv_usage = gauge("pagedlm:kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = full).")
        self.prefix_hit_rate = gauge("pagedlm:prefix_cache_hit_rate",
                                     "Share of looked-up prompt tokens found in the prefix "
                                     "cache.")
        self.prompt_tokens = counter("pagedlm:prompt_tokens",
                                     "Prompt tokens computed (recomputation after preemption "
                                     "included).")
        self.generation_tokens = counter("pagedlm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("pagedlm:num_preemptions", "Requests preempted.")
        self._finished = Counter("pagedlm:request_finished",
                                 "Requests finished, by reason (stop, length, abort); a request "
                                 "with n > 1 counts once, with its first sequence's reason.",
                                 labels + ["finished_reason"], registry=r)
        self.finished = {reason: self._finished.labels(model_name, reason)
                         for reason in ("stop", "length", "abort")}
        self.ttft = histogram("pagedlm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", _TTFT_BUCKETS)
        self.itl = histogram("pagedlm:inter_token_latency_seconds",
                             "Time between successive outputs of a streamed request.",
                             _ITL_BUCKETS)
        self.tpot = histogram("pagedlm:request_time_per_output_token_seconds",
                              "Per request: (finish - first token) / (output tokens - 1).",
                              _ITL_BUCKETS)
        self.e2e = histogram("pagedlm:e2e_request_latency_seconds",
                             "Time from arrival to finish.", _E2E_BUCKETS)
        # vLLM's lora_requests_info: one sample, the running adapters in a label.
        self.lora_info = Gauge("pagedlm:lora_requests_info", "Running LoRA adapters (a "
                               "comma-separated label) and max_lora; the value is the update "
                               "time.", ["running_lora_adapters", "max_lora"], registry=r)
        self.num_running_loras = gauge("pagedlm:num_running_lora_adapters",
                                       "Distinct LoRA adapters among the running requests.")
        self.speculative = speculative
        if speculative:  # vLLM's names (v1's counters, v0's acceptance-rate gauge)
            self.spec_drafts = counter("pagedlm:spec_decode_num_drafts",
                                       "Sequence-steps that verified at least one draft token.")
            self.spec_draft_tokens = counter("pagedlm:spec_decode_num_draft_tokens",
                                             "Draft tokens verified.")
            self.spec_accepted_tokens = counter("pagedlm:spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted.")
            self.spec_acceptance_rate = gauge("pagedlm:spec_decode_draft_acceptance_rate",
                                              "Accepted / verified draft tokens since start-up.")
            self.spec_mean_length = gauge("pagedlm:spec_decode_mean_acceptance_length",
                                          "Tokens emitted per verifying sequence-step (accepted "
                                          "drafts + 1) since start-up.")
        self.num_finished: dict[str, int] = {}  # the same counts, readable without a scrape
        self.snapshot = EngineSnapshot()
        self._last_log_time = time.monotonic()
        self._last_logged = EngineSnapshot()

    def update(self, snap: EngineSnapshot) -> None:
        """Publish the engine's state; counters advance by what changed since the last call."""
        old = self.snapshot
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.swapped.set(snap.num_swapped)
        self.kv_usage.set(snap.kv_cache_usage)
        self.prefix_hit_rate.set(snap.prefix_cache_hit_rate)
        self.prompt_tokens.inc(max(0, snap.prompt_tokens - old.prompt_tokens))
        self.generation_tokens.inc(max(0, snap.generation_tokens - old.generation_tokens))
        self.preemptions.inc(max(0, snap.preemptions - old.preemptions))
        if self.speculative:
            new = snap.spec_decode - old.spec_decode
            self.spec_drafts.inc(max(0, new.num_drafts))
            self.spec_draft_tokens.inc(max(0, new.num_draft_tokens))
            self.spec_accepted_tokens.inc(max(0, new.num_accepted_tokens))
            self.spec_acceptance_rate.set(snap.spec_decode.acceptance_rate)
            self.spec_mean_length.set(snap.spec_decode.mean_acceptance_length)
        if snap.max_loras:
            self.num_running_loras.set(len(snap.running_loras))
            if snap.running_loras != old.running_loras or not old.max_loras:
                self.lora_info.clear()
                self.lora_info.labels(",".join(snap.running_loras),
                                      str(snap.max_loras)).set(time.time())
        self.snapshot = snap

    def observe(self, t: RequestTimes, out, now: float) -> None:
        """A request's output (a RequestOutput, or an embedding's): its latencies, and its
        finish reason once it finishes."""
        new = 0
        completions = out.outputs if isinstance(out, RequestOutput) else []  # none: embeddings
        for c in completions:
            before = t.tokens.get(c.index, 0)
            total = before + len(c.token_ids) if t.kind is RequestOutputKind.DELTA \
                else len(c.token_ids)
            t.tokens[c.index] = total
            new += total - before
        first = out.metrics.first_token_time if out.metrics else None
        if first is not None and not t.ttft_recorded:
            self.ttft.observe(max(0.0, first - t.arrival_time))
            t.ttft_recorded = True
        if new > 0 and t.kind is not RequestOutputKind.FINAL_ONLY:
            if t.last_output_time is not None:
                self.itl.observe(now - t.last_output_time)
            t.last_output_time = now
        if out.finished:
            self.e2e.observe(max(0.0, now - t.arrival_time))
            num_tokens = max(t.tokens.values(), default=0)
            if first is not None and num_tokens > 1:
                self.tpot.observe(max(0.0, now - first) / (num_tokens - 1))
            reason = (completions[0].finish_reason if completions
                      else None if isinstance(out, RequestOutput) else "stop")
            self.record_finished(reason if reason in self.finished else "length")

    def record_finished(self, reason: str) -> None:
        self.finished[reason].inc()
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1

    def maybe_log(self, interval: float, now: float | None = None) -> bool:
        """Log vLLM's stats line if `interval` seconds passed and anything happened."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_log_time
        if elapsed < interval:
            return False
        snap, last = self.snapshot, self._last_logged
        prompt_tps = (snap.prompt_tokens - last.prompt_tokens) / elapsed
        gen_tps = (snap.generation_tokens - last.generation_tokens) / elapsed
        self._last_log_time = now
        self._last_logged = snap
        if not (prompt_tps or gen_tps or snap.num_running or snap.num_waiting
                or snap.num_swapped):
            return False  # idle: stay quiet
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache "
                    "usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d", prompt_tps,
                    gen_tps, snap.num_running, snap.num_swapped, snap.num_waiting,
                    100 * snap.kv_cache_usage, 100 * snap.prefix_cache_hit_rate,
                    snap.preemptions)
        spec = snap.spec_decode - last.spec_decode
        if self.speculative and spec.num_drafts:
            logger.info("SpecDecoding metrics: %s", spec.summary())
        return True
