"""Serving capacity at an SLO: the highest Poisson request rate a server sustains while the p99 of
time to first token and the p99 of time per output token stay within bounds (vLLM's "goodput"
idea, reduced to one number per system).

A point is one run at a fixed rate: max(min_requests, rate x duration) requests, so that the p99
of a slow rate is not simply its slowest request. The search measures a start rate, doubles or
halves it until the SLO's boundary is bracketed, then bisects the bracket until it is narrower
than `precision` of its upper end (or the point budget is spent). It assumes that a rate that
fails the SLO fails at every higher rate; noise near the boundary can break that, which is why
every point is kept in the result.
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass
from typing import Callable

from lib.client import RequestResult, TtftBound
from lib.stats import quantile
from lib.workload import Request, arrival_times, make_requests


@dataclass(frozen=True)
class Slo:
    ttft_p99_ms: float = 1000.0
    tpot_p99_ms: float = 100.0


@dataclass(frozen=True)
class Point:
    rate: float  # requests/s asked for
    requests: int
    failed: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    output_throughput: float  # output tokens/s over the point's wall time
    duration_s: float
    # Set when the point stopped as soon as its TTFT p99 was known to miss the SLO (seconds
    # into it); requests and failed then count the requests sent by then, and the two p99s
    # are over the requests answered by then: lower bounds.
    stopped_at_s: float | None = None

    def meets(self, slo: Slo) -> bool:
        return (self.stopped_at_s is None and self.failed == 0
                and self.ttft_p99_ms <= slo.ttft_p99_ms and self.tpot_p99_ms <= slo.tpot_p99_ms)


@dataclass(frozen=True)
class Search:
    start_rate: float = 1.0  # requests/s of the first point
    precision: float = 0.1  # stop when (high - low) / high is at most this
    max_points: int = 8
    min_rate: float = 0.05  # below this the system is said to have no capacity at all

    def __post_init__(self) -> None:
        if not (self.start_rate > 0 and 0 < self.precision < 1 and self.max_points >= 1
                and 0 < self.min_rate <= self.start_rate):
            raise ValueError(f"bad capacity search settings: {self}")


@dataclass(frozen=True)
class Capacity:
    rate: float  # the highest rate measured that met the SLO; 0.0 if none did
    points: list[Point]  # in the order measured
    bracketed: bool  # a failing rate above `rate` was measured (else the search ran out)

    def to_json(self, slo: Slo) -> dict:
        return {"rate": self.rate, "bracketed": self.bracketed, "slo": asdict(slo),
                "points": [asdict(p) | {"meets_slo": p.meets(slo)} for p in self.points]}


def find_capacity(measure: Callable[[float], Point], slo: Slo, search: Search) -> Capacity:
    """The highest rate at which measure(rate) meets the SLO, to the search's precision."""
    points: list[Point] = []
    low, high = 0.0, math.inf  # highest passing, lowest failing

    def probe(rate: float) -> bool:
        nonlocal low, high
        point = measure(rate)
        points.append(point)
        if point.meets(slo):
            low = max(low, rate)
            return True
        high = min(high, rate)
        return False

    rate = search.start_rate
    if probe(rate):
        while len(points) < search.max_points and math.isinf(high):
            rate *= 2
            probe(rate)
    else:
        while len(points) < search.max_points and low == 0.0:
            rate /= 2
            if rate < search.min_rate:
                break
            probe(rate)
    while (len(points) < search.max_points and low > 0 and not math.isinf(high)
           and (high - low) / high > search.precision):
        probe((low + high) / 2)
    return Capacity(low, points, not math.isinf(high))


def point_size(rate: float, duration_s: float, min_requests: int) -> int:
    """Requests in a point: the duration's worth at this rate, and never fewer than
    min_requests."""
    return max(min_requests, math.ceil(rate * duration_s))


def point_workload(vocab: list[int], rate: float, n: int, input_len: int, output_len: int,
                   seed: int) -> tuple[list[Request], list[float]]:
    """The requests and arrival times of a point; the same for every system measured at this
    rate with this seed."""
    rng = random.Random(f"{seed}-capacity-{rate:.6f}")
    requests = make_requests(vocab, n, (input_len, input_len), (output_len, output_len), rng)
    return requests, arrival_times(rate, rng, num=n)


def ttft_bound(n: int, slo: Slo) -> TtftBound:
    """The point of n requests misses the SLO for certain once this many of them take longer
    than its TTFT bound: the nearest-rank p99 of n values is the ceil(0.99 n)-th smallest."""
    return TtftBound(slo.ttft_p99_ms / 1000, n - math.ceil(0.99 * n) + 1)


def point_of(rate: float, results: list[RequestResult], elapsed: float,
             bound: TtftBound | None = None) -> Point:
    stopped = bound is not None and bound.stopped_at is not None
    if stopped:
        # The requests cancelled in flight (no answer and no error) are not failures.
        results = [r for r in results if r.start > 0.0]
        failed = sum(1 for r in results if r.error)
    else:
        failed = sum(1 for r in results if not r.ok)
    ok = [r for r in results if r.ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return Point(rate=rate, requests=len(results), failed=failed,
                 ttft_p99_ms=1000 * quantile([r.ttft for r in ok], 0.99),
                 tpot_p99_ms=1000 * quantile(tpot, 0.99),
                 output_throughput=sum(r.output_tokens for r in ok) / elapsed,
                 duration_s=elapsed, stopped_at_s=bound.stopped_at if stopped else None)


def add_args(p: argparse.ArgumentParser) -> None:
    """The SLO and the search, as serving.py and compare.py take them."""
    g = p.add_argument_group("capacity at an SLO")
    g.add_argument("--slo-ttft-p99-ms", type=float, default=Slo.ttft_p99_ms)
    g.add_argument("--slo-tpot-p99-ms", type=float, default=Slo.tpot_p99_ms)
    g.add_argument("--capacity-duration", type=float, default=60.0, metavar="SECONDS",
                   help="Seconds of arrivals per point.")
    g.add_argument("--capacity-min-requests", type=int, default=200,
                   help="Requests per point at least, so that p99 is not just the maximum.")
    g.add_argument("--capacity-start-rate", type=float, default=Search.start_rate,
                   help="Requests/s of the first point.")
    g.add_argument("--capacity-precision", type=float, default=Search.precision,
                   help="Stop bisecting when the bracket is this share of its upper end.")
    g.add_argument("--capacity-max-points", type=int, default=Search.max_points)
    g.add_argument("--capacity-full-points", action="store_true",
                   help="Run every point to its end, also once its TTFT p99 is known to miss "
                        "the SLO (by default such a point stops there).")


def settings(args: argparse.Namespace) -> tuple[Slo, Search]:
    """(Slo, Search) from add_args' options; ValueError names a bad one."""
    if not args.capacity_duration > 0 or args.capacity_min_requests < 1:
        raise ValueError("--capacity-duration must be > 0 and --capacity-min-requests >= 1")
    if not args.slo_ttft_p99_ms > 0 or not args.slo_tpot_p99_ms > 0:
        raise ValueError("the SLO bounds must be > 0")
    search = Search(start_rate=args.capacity_start_rate, precision=args.capacity_precision,
                    max_points=args.capacity_max_points,
                    min_rate=min(Search.min_rate, args.capacity_start_rate))
    return Slo(args.slo_ttft_p99_ms, args.slo_tpot_p99_ms), search
