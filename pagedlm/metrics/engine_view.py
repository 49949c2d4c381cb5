"""EngineView: what the web page's engine view shows, taken on the engine thread on demand.

The server's /engine/events stream asks for one a few times a second while someone watches;
nothing is computed otherwise. It carries request ids and token counts, never prompt or output
text (the page may be open to other users of the server).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlm.metrics.tracer import block_map

if TYPE_CHECKING:
    from pagedlm.core.scheduler import Scheduler
    from pagedlm.metrics.stats import EngineStats
    from pagedlm.sequence import SequenceGroup


@dataclass
class RequestView:
    request_id: str
    queue: str  # "running", "waiting" or "swapped"
    num_seqs: int
    num_prompt_tokens: int
    num_output_tokens: int  # the longest sequence's
    num_computed_tokens: int  # of the first sequence: its K/V in the cache
    num_blocks: int  # distinct blocks its sequences hold


@dataclass
class EngineView:
    time: float  # time.time() when taken
    num_blocks: int
    block_size: int
    block_map: str  # one of metrics.tracer's FREE/USED/SHARED/CACHED per device block
    requests: list[RequestView] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    # Totals since start-up: the page takes differences between views for rates per step.
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    prefix_cache_hit_rate: float = 0.0
    # Speculative decoding (the page shows it only when on): totals since start-up.
    speculative: bool = False
    spec_num_draft_tokens: int = 0  # drafts verified
    spec_num_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0  # accepted / verified drafts
    spec_mean_acceptance_length: float = 0.0  # tokens per verifying sequence-step


def _request_view(group: "SequenceGroup", queue: str) -> RequestView:
    seqs = group.unfinished_seqs() or group.seqs
    return RequestView(group.request_id, queue, len(seqs), seqs[0].num_prompt_tokens,
                       max(s.num_output_tokens for s in seqs), seqs[0].num_computed_tokens,
                       len({b for s in seqs for b in s.block_table}))


def take_engine_view(sched: "Scheduler", st: "EngineStats") -> EngineView:
    """On the engine's thread: the scheduler's queues and blocks, and the engine's totals."""
    bm = sched.block_manager
    view = EngineView(time=time.time(), num_blocks=bm.num_blocks, block_size=bm.block_size,
                      block_map=block_map(bm.device), num_running=len(sched.running),
                      num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
                      num_steps=st.num_steps, num_prompt_tokens=st.num_prompt_tokens,
                      num_generation_tokens=st.num_generation_tokens,
                      num_preemptions=st.num_preemptions, num_swapped_out=st.num_swapped_out,
                      num_swapped_in=st.num_swapped_in,
                      prefix_cache_hit_rate=bm.prefix_hit_rate())
    if sched.spec_policy is not None:
        spec = st.spec_decode
        view.speculative = True
        view.spec_num_draft_tokens = spec.num_draft_tokens
        view.spec_num_accepted_tokens = spec.num_accepted_tokens
        view.spec_acceptance_rate = spec.acceptance_rate
        view.spec_mean_acceptance_length = spec.mean_acceptance_length
    for queue in ("running", "waiting", "swapped"):
        view.requests += [_request_view(g, queue) for g in getattr(sched, queue)]
    return view
