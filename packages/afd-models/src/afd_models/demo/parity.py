"""Token-for-token comparison of two completion runs over the same prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from afd_models.demo.client import Completion


@dataclass(frozen=True)
class PromptParity:
    """Token-for-token comparison of one prompt; ``mismatch_index`` is None when identical."""

    prompt: str
    expected: tuple[int, ...]
    actual: tuple[int, ...]
    mismatch_index: int | None

    @property
    def ok(self) -> bool:
        return self.mismatch_index is None


@dataclass(frozen=True)
class ParityResult:
    """Per-prompt parity of a candidate run against a baseline run."""

    prompts: tuple[PromptParity, ...]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.prompts)

    @property
    def mismatches(self) -> tuple[PromptParity, ...]:
        return tuple(p for p in self.prompts if not p.ok)

    def describe(self) -> str:
        lines = []
        for p in self.prompts:
            if p.ok:
                lines.append(f"OK   {p.prompt!r}: {len(p.expected)} tokens identical")
            else:
                i = p.mismatch_index
                lines.append(
                    f"DIFF {p.prompt!r} at token {i}: expected {list(p.expected)} "
                    f"got {list(p.actual)}"
                )
        return "\n".join(lines)


def first_mismatch(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return i
    if len(expected) != len(actual):
        return min(len(expected), len(actual))
    return None


def compare_parity(baseline: Sequence[Completion], candidate: Sequence[Completion]) -> ParityResult:
    """Compare two runs prompt by prompt; the runs must cover the same prompts in order."""
    if [c.prompt for c in baseline] != [c.prompt for c in candidate]:
        raise ValueError("baseline and candidate must cover the same prompts in the same order")
    return ParityResult(
        tuple(
            PromptParity(
                b.prompt, b.token_ids, c.token_ids, first_mismatch(b.token_ids, c.token_ids)
            )
            for b, c in zip(baseline, candidate, strict=True)
        )
    )
