"""The stop check: after a token is appended, has the sequence ended, and why?

One function for every caller: the output processor (sampled tokens) and beam search (candidate
tokens, which carry no text).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.sampling_params import SamplingParams
from pagedlm.sequence import SequenceStatus


@dataclass
class StopDecision:
    status: SequenceStatus
    stop_reason: int | str | None = None  # the stop token id or string; None for EOS / length
    text_end: int | None = None  # where the output text is cut; None: keep it whole


def check_stop(params: SamplingParams, eos_token_ids: frozenset[int], max_model_len: int,
               seq_len: int, num_output_tokens: int, token_id: int, text: str = "",
               new_chars: int = 0) -> StopDecision | None:
    """seq_len / num_output_tokens count the new token; text is the output text with the new
    token's new_chars characters at its end."""
    if num_output_tokens >= params.min_tokens:
        eos = not params.ignore_eos and token_id in eos_token_ids
        if eos or token_id in params.all_stop_token_ids:
            # As in vLLM, the stopping token's text is left out of the output.
            cut = new_chars and not params.include_stop_str_in_output
            return StopDecision(SequenceStatus.FINISHED_STOPPED, None if eos else token_id,
                                len(text) - new_chars if cut else None)
        if params.stop_strings and new_chars:
            # Only where the new text could complete a stop string: matches that straddle
            # token boundaries are found, and the scan stays short.
            start = max(0, len(text) - new_chars - params.max_stop_len + 1)
            # The text ends at the first stop string in it, whichever the list names first
            # (where one token brought two, the list's order chose, and the text kept a stop
            # string); of two that start at the same place, the shorter, which a
            # character-by-character check would have met first.
            found = [(idx, idx + len(stop), stop) for stop in params.stop_strings
                     if (idx := text.find(stop, start)) != -1]
            if found:
                idx, stop_end, stop = min(found, key=lambda f: f[:2])
                end = stop_end if params.include_stop_str_in_output else idx
                return StopDecision(SequenceStatus.FINISHED_STOPPED, stop, end)
    if num_output_tokens >= params.max_tokens or seq_len >= max_model_len:
        return StopDecision(SequenceStatus.FINISHED_LENGTH)
    return None
