"""DDTree: the best-first tree over a block drafter's per-position marginals.

A block drafter (drafters.block) gives, in one forward, row d of (D, V) marginals: its
distribution of the token at depth d + 1 given the context only. A path's score is the product
of its tokens' marginals, which never rises along a path, so the N best paths form a tree; it
is the tree of N nodes with the most expected accepted tokens *if* the marginals were the
target's acceptance probabilities and depths independent (DDTree's factorised objective). Its
children are chosen (top-k), so the tree carries no draft rows: every rule treats them as
one-hot proposals, which is exact. Giving them their marginal rows as if drawn would not be
(tests/drafters/test_block_trees.py measures the bias).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafters.trees.cost import StepCost, cut_to_cost
from verify.tree import TokenTree, TreeBuilder


@dataclass(frozen=True)
class DDTree:
    """Best-first tree over a block's marginals: the `total_tokens` draft nodes (root not
    counted) whose paths have the highest product of marginals, no deeper than `depth` (None:
    the block's depth). With a measured `cost`, each step keeps only the nodes that pay for
    their verification (drafters.trees.cost.cut_to_cost, on the path scores)."""

    total_tokens: int
    depth: int | None = None
    cost: StepCost | None = None

    def __post_init__(self) -> None:
        for name in ("total_tokens", "depth"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"DDTree.{name} must be an integer >= 1, got {value!r}")

    def grow(self, root: int, log_probs: torch.Tensor) -> TokenTree:
        """The tree below `root` from (D, V) marginal log-probabilities."""
        depth = self._depth(log_probs.shape[0])
        return self._sized(best_first(root, log_probs[:depth], self.total_tokens))

    def grow_over(self, root: int, ranked_children: RankedChildren, block_depth: int
                  ) -> TokenTree:
        """The tree below `root` whose nodes' children `ranked_children` ranks (best_first_over),
        for a block of `block_depth` positions whose rows depend on the parent's token."""
        return self._sized(best_first_over(root, ranked_children, self._depth(block_depth),
                                           self.total_tokens))

    def _depth(self, block_depth: int) -> int:
        return block_depth if self.depth is None else min(self.depth, block_depth)

    def _sized(self, builder: TreeBuilder) -> TokenTree:
        tree = builder.build()
        return tree if self.cost is None else cut_to_cost(tree, self.cost, draft_forwards=1)


def best_first(root: int, log_probs: torch.Tensor, budget: int) -> TreeBuilder:
    """A scored TreeBuilder of the `budget` best paths by summed (D, V) log-probabilities.

    Each depth's candidates are its `budget` best tokens (no kept path can use a worse one:
    its better siblings would outscore it), ranked once by topk, not a sort of the whole
    vocabulary (~15 ms for 7 x 49k here). Tokens the draft cannot propose never enter."""
    ranked = log_probs.float().topk(min(max(budget, 1), log_probs.shape[-1]), dim=-1)
    values, tokens = ranked.values.tolist(), ranked.indices.tolist()
    return best_first_over(root, lambda depth, parent_token: (values[depth], tokens[depth]),
                           len(values), budget)


# (depth d, the parent's token) -> the children's (log-probabilities, tokens), best first, of a
# node at depth d: a block's marginal row d whatever the parent (best_first), or a row that
# depends on the parent's token (DSpark's Markov head)
RankedChildren = Callable[[int, int], tuple[list[float], list[int]]]


def best_first_over(root: int, ranked_children: RankedChildren, max_depth: int, budget: int
                    ) -> TreeBuilder:
    """A scored TreeBuilder of the `budget` best paths by summed log-probabilities, the
    children of each node ranked by `ranked_children` (asked once per node that gets one),
    no deeper than `max_depth`.

    A popped node (path ..., rank r among its parent's children) queues its next sibling
    (rank r + 1) and its first child (rank 0): every node enters the heap once, after its
    parent and its better sibling, so the paths come out best first whenever scores never
    rise along a path. Ties pop shallower, then earlier, first."""
    builder = TreeBuilder(root, scored=True)
    children: dict[int, tuple[list[float], list[int]]] = {}
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, depth, order, parent, rank)
    pushed = 0

    def push(parent: int, rank: int) -> None:
        nonlocal pushed
        depth = builder.depth(parent)
        if depth >= max_depth:
            return
        if parent not in children:
            children[parent] = ranked_children(depth, builder.tokens[parent])
        values = children[parent][0]
        if rank < len(values) and values[rank] > float("-inf"):
            score = builder.log_scores[parent] + values[rank]
            heapq.heappush(heap, (-score, depth, pushed, parent, rank))
            pushed += 1

    push(0, 0)
    while heap and len(builder) <= budget:
        negative, _, _, parent, rank = heapq.heappop(heap)
        node = builder.add(parent, children[parent][1][rank], -negative)
        push(parent, rank + 1)
        push(node, 0)
    return builder
