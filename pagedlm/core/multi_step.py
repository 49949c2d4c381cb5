"""Multi-step decoding (vLLM's num_scheduler_steps): how many iterations a decoding sequence
gets in a step.

A step of decodes normally costs a full trip through the host per token: schedule, build the
inputs, run, copy the sampled ids back, detokenize, check stops. On a GPU a small model's
forward takes less time than that trip. With num_scheduler_steps = N the worker runs the model
up to N times in one step, feeding each iteration's sampled ids to the next on the device, and
the host work runs once per N tokens.

The scheduler reserves the slots of the later iterations as lookahead slots (as speculative
decoding reserves drafts' slots): k = N - 1, fewer where max_tokens or max_model_len leave less
room, 0 for a request the device cannot sample alone (SamplingParams.allows_multi_step). The
output processor appends the k + 1 tokens one at a time with every stop check; a stop drops the
rest (their K/V sits in slots the finished sequence frees).
"""
from __future__ import annotations

from pagedlm.sequence import Sequence, SequenceGroup


def multi_step_lookahead(group: SequenceGroup, seq: Sequence, num_steps: int,
                         max_model_len: int) -> int:
    """The sequence's lookahead slots this step: its iterations after the first."""
    if group.structured_output is not None or not group.sampling_params.allows_multi_step:
        return 0
    # Tokens it may still emit after the first, and positions left in the model.
    left = group.sampling_params.max_tokens - seq.num_output_tokens - 1
    room = max_model_len - len(seq.token_ids)
    return max(0, min(num_steps - 1, left, room))
