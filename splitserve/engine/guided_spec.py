"""What a structured-output request asks for (torch-free; travels in SamplingParams and over gRPC).

The matcher that enforces it lives in :mod:`splitserve.engine.guided` (grammar library backed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
GUIDED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """A constraint on the generated text.

    Attributes:
        kind: "json_schema" (``spec`` = the schema as JSON text), "json_object" (any JSON object; ``spec`` ""),
            "regex" (``spec`` = the pattern), "choice" (``spec`` = a JSON list of the allowed strings),
            "grammar" (``spec`` = a Lark / EBNF grammar text, vLLM's ``guided_grammar``).
        spec: see ``kind``.

    Raises:
        ValueError: unknown kind.
    """

    kind: GuidedKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"unknown structured-output kind {self.kind!r}; expected one of {GUIDED_KINDS}")
