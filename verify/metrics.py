"""What a decoding run's steps say about its drafter: tau and acceptance by depth.

One step is one target forward; it accepts `accepted` draft tokens (0 .. tree depth) and adds
the bonus token the target predicts after them, so it produces accepted + 1 tokens.

Every figure here pools steps: a run of several prompts (or batches, or repeats) counts each
step once, whichever prompt it came from. A mean of per-prompt figures would weigh a prompt
that stopped after 3 steps like one that ran 300.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def step_tokens(accepted: Iterable[int]) -> list[int]:
    """Tokens each step produced: its accepted drafts plus the bonus token."""
    return [count + 1 for count in accepted]


@dataclass(frozen=True)
class TokensPerForward:
    """Tokens produced by some steps (bonus tokens included) and the target forwards that
    produced them. Tallies add up across prompts, batches and repeats, so `tau` of the sum
    pools their steps."""

    tokens: int = 0
    forwards: int = 0

    @staticmethod
    def of(accepted: Iterable[int]) -> TokensPerForward:
        """The tally of steps accepting `accepted` drafts each (one count per step)."""
        produced = step_tokens(accepted)
        return TokensPerForward(sum(produced), len(produced))

    def __add__(self, other: TokensPerForward) -> TokensPerForward:
        return TokensPerForward(self.tokens + other.tokens, self.forwards + other.forwards)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward, bonus included; 0.0 when no step ran."""
        return self.tokens / self.forwards if self.forwards else 0.0


def tau(accepted: Iterable[int]) -> float:
    """Mean tokens per target forward of steps accepting `accepted` drafts each."""
    return TokensPerForward.of(accepted).tau


def acceptance_by_depth(accepted: Sequence[int], tree_depths: Sequence[int]
                        ) -> list[float | None]:
    """Per draft depth d = 1 .. the deepest tree: the share of the steps that tried a depth-d
    draft which accepted it; None for a depth no step tried.

    A step tries depth d when its tree reaches d and it accepted depths 1 .. d - 1: a step
    that stopped earlier says nothing about depth d. accepted[i], tree_depths[i]: step i's
    accepted drafts and its tree's depth (root at 0).
    """
    if len(accepted) != len(tree_depths):
        raise ValueError(f"{len(accepted)} accepted counts for {len(tree_depths)} tree depths")
    rates = []
    for depth in range(1, max(tree_depths, default=0) + 1):
        tried = [count for count, reach in zip(accepted, tree_depths)
                 if reach >= depth and count >= depth - 1]
        rates.append(sum(count >= depth for count in tried) / len(tried) if tried else None)
    return rates


def accepted_histogram(accepted: Sequence[int]) -> list[float]:
    """Share of steps accepting 0, 1, 2, ... drafts, up to the most any step accepted."""
    if not accepted:
        return []
    return [sum(count == k for count in accepted) / len(accepted)
            for k in range(max(accepted) + 1)]
