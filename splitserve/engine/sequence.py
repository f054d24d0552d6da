"""Per-request state inside an engine (plain Python, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from splitserve.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.guided import GuidedMatcher
    from splitserve.engine.logprobs import PromptLogprobs


class SeqMode(enum.Enum):
    GENERATE = "generate"  # prefill locally, then decode until finished
    PREFILL_ONLY = "prefill_only"  # prefill, sample the first token, hand the KV blocks to the caller
    DECODE_PREFILLED = "decode_prefilled"  # KV of the prompt already in its blocks (transferred)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request.

    ``num_computed_tokens`` tokens of ``token_ids`` (prompt + outputs) have K/V in the cache;
    the next forward feeds ``token_ids[num_computed_tokens:]`` (the whole prompt at prefill,
    the last sampled token at decode), or only its first ``num_scheduled_tokens`` when the
    scheduler set that (a chunk of a chunked prefill).

    n > 1: a PREFILL_ONLY sequence samples the first token of all ``params.n`` choices from one prompt; the
    choices then decode as separate sequences (one per ``index``, same ``request_id``, ``params.for_choice``)
    that share the prompt's full KV blocks. ``matcher`` is the structured-output grammar state of this
    sequence (None without ``params.guided``). ``prompt_logprobs`` (one entry per prompt token) is filled by
    the runner while the prompt is computed, when ``params.prompt_logprobs`` is set. ``step_results`` holds
    what the runner sampled in the step just run (``splitserve.engine.sampler.SampleResult``, one per
    choice), consumed by the engine core.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    mode: SeqMode = SeqMode.GENERATE
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    cached_tokens: int = 0
    num_scheduled_tokens: int = 0  # tokens fed by the current step (0 = all new tokens)
    queued_at: float | None = None  # when it joined the waiting queue (engine clock); None once admitted
    waited_for_blocks: bool = False  # found too few free KV blocks at the head of the queue at least once
    index: int = 0  # the choice of an n > 1 request this sequence decodes
    matcher: GuidedMatcher | None = None
    prompt_logprobs: PromptLogprobs | None = None
    step_results: list[Any] | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix cache keys of full blocks of token_ids, so far
    num_keyed_blocks: int = 0  # leading blocks of block_table the prefix cache has keyed
    # KV push: called (engine thread) with (block_table, layers done) after each layer of the step completing the prompt
    on_layers: Callable[[list[int], int], None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_step_tokens(self) -> int:
        """Tokens the current step feeds: ``num_scheduled_tokens`` if set, else all new tokens."""
        return self.num_scheduled_tokens or self.num_new_tokens

    @property
    def is_partial_prefill(self) -> bool:
        """True when the current step feeds a chunk that leaves prompt tokens uncomputed (nothing is sampled)."""
        return self.num_computed_tokens + self.num_step_tokens < self.num_tokens
