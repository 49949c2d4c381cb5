"""Speculative decoding's observability on hand-built counts: the acceptance figures, the
Prometheus metrics and stats line, and the Chrome trace's speculation track. (An engine that
speculates is checked end to end in test_spec_distribution.py.)"""
from __future__ import annotations

import logging
import re

from prometheus_client import generate_latest

from pagedlm.core.scheduler_output import SchedulerStats
from pagedlm.metrics.prometheus import EngineMetrics, EngineSnapshot
from pagedlm.metrics.stats import SpecDecodeCounts
from pagedlm.metrics.tracer import chrome_trace


def test_acceptance_rate_and_mean_acceptance_length():
    stats = SchedulerStats(spec_num_drafts=40, spec_num_accepted=30, spec_num_verifies=10)
    counts = SpecDecodeCounts.of(stats)
    assert counts.acceptance_rate == 0.75
    assert counts.mean_acceptance_length == 4.0  # 3 accepted a step, and the token after them
    assert SpecDecodeCounts().acceptance_rate == SpecDecodeCounts().mean_acceptance_length == 0
    later = SpecDecodeCounts(50, 31, 15) - counts
    assert (later.num_draft_tokens, later.num_accepted_tokens, later.num_drafts) == (10, 1, 5)
    assert "Mean acceptance length: 1.20" in later.summary()
    assert "Draft acceptance rate: 10.0%" in later.summary()


def _values(metrics: EngineMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(pagedlm:spec_decode_\w+)\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
            if not m.group(1).endswith("_created")}


def test_prometheus_counters_and_gauges_follow_the_totals():
    metrics = EngineMetrics("m", speculative=True)
    metrics.update(EngineSnapshot(spec_decode=SpecDecodeCounts(8, 6, 2)))
    metrics.update(EngineSnapshot(spec_decode=SpecDecodeCounts(12, 7, 4)))
    assert _values(metrics) == {
        "pagedlm:spec_decode_num_drafts_total": 4,
        "pagedlm:spec_decode_num_draft_tokens_total": 12,
        "pagedlm:spec_decode_num_accepted_tokens_total": 7,
        "pagedlm:spec_decode_draft_acceptance_rate": 7 / 12,
        "pagedlm:spec_decode_mean_acceptance_length": 1 + 7 / 4,
    }
    # An engine without speculation exports none of them.
    assert _values(EngineMetrics("m")) == {}


def test_stats_line_reports_the_interval(caplog):
    metrics = EngineMetrics("m", speculative=True)
    metrics.update(EngineSnapshot(num_running=1, spec_decode=SpecDecodeCounts(8, 6, 2)))
    with caplog.at_level(logging.INFO, logger="pagedlm.metrics.prometheus"):
        assert metrics.maybe_log(1.0, now=metrics._last_log_time + 2)
        metrics.update(EngineSnapshot(num_running=1, spec_decode=SpecDecodeCounts(12, 6, 4)))
        assert metrics.maybe_log(1.0, now=metrics._last_log_time + 2)
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert len(lines) == 2
    assert "Mean acceptance length: 4.00" in lines[0] and "Drafted: 8 tokens" in lines[0]
    # The second interval: 4 drafts, none accepted.
    assert "Mean acceptance length: 1.00" in lines[1] and "rate: 0.0%" in lines[1]


def test_chrome_trace_has_a_speculation_track_only_when_drafts_were_verified():
    def step(i, drafted, accepted):
        return {"step": i, "start": i * 0.01, "duration": 0.01, "num_batched_tokens": 3,
                "token_budget": 64, "cow_copies": 0, "device": {}, "preempted": [],
                "swapped_in": [], "running": 1, "waiting": 0, "swapped": 0, "block_map": "u.",
                "times": dict.fromkeys(("schedule", "prepare", "forward", "sample", "output"),
                                       0.0),
                "scheduled": [{"request_id": "r", "seq_id": 0, "kind": "decode",
                               "num_tokens": 1, "num_computed_tokens": 9, "lookahead": 2}],
                "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted}

    events = chrome_trace({}, [step(0, 2, 1), step(1, 0, 0)])["traceEvents"]
    track = [e["args"] for e in events if e.get("name") == "speculation"]
    assert track == [{"drafted": 2, "accepted": 1}, {"drafted": 0, "accepted": 0}]
    seq = next(e for e in events if e.get("cat") == "decode")
    assert seq["args"]["lookahead"] == 2
    plain = chrome_trace({}, [step(0, 0, 0)])["traceEvents"]
    assert not [e for e in plain if e.get("name") == "speculation"]
