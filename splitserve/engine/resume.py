"""Resumed sequences: a choice continued on this engine from the tokens it already generated elsewhere (decode
migration: the router moves a stream whose decode worker failed mid-stream).

The resumed sequence is a GENERATE sequence whose output history is seeded with those tokens: the engine prefills
``prompt + output`` (exactly what it does for a sequence preempted and recomputed) and samples output token
``len(output)`` from the last position. Every sampling rule sees the tokens as output, as on the worker that
generated them:

* ``max_tokens`` counts them (the continuation generates ``max_tokens - len(output)`` at most), and so does
  ``min_tokens`` (its EOS / stop-id ban ends at the same output index);
* presence / frequency penalties and bad words see them as output, the repetition penalty as prompt + output;
* ``stop_token_ids`` / EOS / ``max_model_len`` stop rules count the same tokens;
* the structured-output grammar matcher is replayed over them;
* with a seed, output token i is drawn from the generator seeded with (seed, i) (``splitserve.engine.sampler``), so a
  seeded choice continues its random stream where it stopped; logprobs continue per token.

Greedy continuations therefore give the tokens of an uninterrupted run, as long as the recomputed logits pick the
same argmax (one prefill over prompt + output instead of token-by-token decode: the float32 sums differ in the last
bits, as after a preemption). The same holds for seeded draws (a draw near a CDF boundary could flip).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import TYPE_CHECKING

from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence, SeqMode
from splitserve.errors import InvalidRequest

if TYPE_CHECKING:
    from splitserve.engine.guided import GuidedMatcher

StopRule = Callable[[SamplingParams, int, int, int], "str | None"]


def resume_sequence(request_id: str, prompt_token_ids: list[int], params: SamplingParams, output_token_ids: Seq[int],
                    vocab_size: int, stop_reason: StopRule, matcher: GuidedMatcher | None) -> Sequence:
    """A GENERATE sequence for ``prompt_token_ids`` whose output history is ``output_token_ids`` (see the module doc).

    Args:
        stop_reason: the scheduler's stop rule (``Scheduler.stop_reason``), replayed over the output tokens.
        matcher: a fresh grammar matcher for ``params.guided`` (None without); advanced over the output tokens.

    Raises:
        InvalidRequest: ``params.n`` > 1 (a resume continues one choice), a token outside ``[0, vocab_size)``, a
            token that already ends the request (stop token, EOS, ``max_tokens``, the context), or one the grammar
            refuses. Nothing is allocated.
    """
    out = list(output_token_ids)
    if params.n != 1:
        raise InvalidRequest(f"resume_output_token_ids continue one choice: n must be 1, got {params.n}")
    if any(not 0 <= t < vocab_size for t in out):
        raise InvalidRequest(f"resume_output_token_ids must be in [0, {vocab_size})")
    for i, token_id in enumerate(out):
        reason = stop_reason(params, token_id, i + 1, len(prompt_token_ids) + i + 1)
        if reason is not None:
            raise InvalidRequest(f"resume_output_token_ids already end the request at output token {i} ({reason}): "
                                 "nothing to continue")
        if matcher is not None and not matcher.accept(token_id):
            raise InvalidRequest(f"resume output token {i} ({token_id}) violates the structured-output grammar")
    seq = Sequence(request_id, list(prompt_token_ids), params, SeqMode.GENERATE)
    seq.output_token_ids = out
    seq.matcher = matcher
    return seq
