"""DSpark's scheduled verification: how much of a drafted chain to verify, from its confidence.

DSpark's confidence head estimates, per draft position k, the chance c_k that the target
accepts the position's token given that every earlier one was accepted; the chance that the
whole prefix up to k survives is c_1 * ... * c_k. Each step drafts a top-1 chain as deep as
the block and keeps the prefix worth verifying:

- with a measured `cost` (drafters.trees.cost), the prefix whose expected tokens per ms,
  (1 + the kept survival chances) / (t(k + 1) + draft ms), is highest, k = 0 decoding plainly;
- with a `threshold` instead, the longest prefix whose survival chance stays at or above it.

The chain's tokens are chosen (top-1), and which of them are kept depends on them, so the
trees are one-hot proposals (TokenTree.keep): exact under every rule that takes chosen drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafters.trees.cost import StepCost, cut_to_cost
from verify.tree import TokenTree, TreeError


@dataclass(frozen=True)
class ConfidenceChain:
    """A top-1 chain of up to `depth` drafts (None: the block's), cut each step by `cost` or
    `threshold` on its nodes' scores (the survival chances); one of the two is given."""

    depth: int | None = None
    cost: StepCost | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.depth is not None and (isinstance(self.depth, bool)
                                       or not isinstance(self.depth, int) or self.depth < 1):
            raise ValueError(f"tree.depth must be an integer >= 1 or null, got {self.depth!r}")
        if (self.cost is None) == (self.threshold is None):
            raise TreeError("a confidence-scheduled chain is cut by a measured cost "
                            "(tree.cost: {measure: true}) or a tree.threshold in (0, 1]: "
                            "give exactly one")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"tree.threshold must be in (0, 1], got {self.threshold}")

    def cut(self, chain: TokenTree) -> TokenTree:
        """The prefix of a scored chain (node k's score: the chance its prefix survives) that
        this schedule verifies."""
        if chain.scores is None:
            raise TreeError("a confidence-scheduled chain needs node scores")
        if self.cost is not None:
            return cut_to_cost(chain, self.cost, draft_forwards=1)
        survive = (chain.scores[1:] >= self.threshold).tolist()
        kept = survive.index(False) if False in survive else len(survive)
        return chain.keep(list(range(kept + 1)))
