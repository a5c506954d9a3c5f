"""Sequoia trees (Chen et al. 2024): the static tree with the most expected tokens for a node
budget and a depth limit, found by dynamic programming, and the (size, depth) that pays best
for a measured verification cost t(n) and draft cost per depth level.

The model is drafters.measured_tree's: the rank-r proposal at depth d is right with probability
accuracies[d][r], a node's value is the product along its path, and a tree's expected tokens
per target forward are 1 (the bonus token) plus its nodes' values. Ranks fill in order among
siblings (rank r needs ranks < r of the same parent: a drafter would close the gap).

Best-first (measured_tree.build_tree) is already optimal when every depth's accuracies fall with
rank: a child is worth at most its parent, a sibling at most its better sibling, so the n best
nodes form a valid tree. It is not when a rank beats a better-ranked one (measured tables of
recycling or a tokenizer-merged draft vocabulary can do that): greedy cannot see past the weak
node that a strong one needs. The DP can, and it also answers for every depth limit at once,
which the cost-aware choice needs: drafting an EAGLE or draft-model tree takes one draft forward
per depth level, so a shallower tree of the same size can win.

The DP, over (depth, levels left, first rank, nodes): S(d, k, r, n) is the best value, relative
to their parent's, of the children of one node at depth d with ranks r, r + 1, ... and their
subtrees, using at most n nodes and k levels. Either that group is empty, or rank r's child is
in with m nodes below it and the n - 1 - m others go to ranks r + 1, ...:

    S(d, k, r, n) = max_m  a[d][r] * (1 + S(d + 1, k - 1, 0, m)) + S(d, k, r + 1, n - 1 - m)

and the best tree of n nodes within depth k has 1 + S(0, k, 0, n) expected tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from drafters.measured_tree import _check_table
from verify.tree import TreeTopology

Choice = tuple[int, ...]  # ranks from the root, as in TreeTopology.choices
# Relative slack under which fewer nodes count as doing as well: the shipped tree is the
# smallest optimal one, and values summed in different orders differ in the last bits.
_TIE = 1e-12


class SequoiaTable:
    """The DP's table for `accuracies` (list over depths of lists over ranks), up to `budget`
    nodes (root not counted) and `max_depth` levels (None: the table's depth)."""

    def __init__(self, accuracies: Sequence[Sequence[float]], budget: int,
                 max_depth: int | None = None):
        _check_table(accuracies)
        if budget < 0 or (max_depth is not None and max_depth < 0):
            raise ValueError(f"budget and max_depth must be >= 0, got {budget}, {max_depth}")
        self.accuracies = [list(row) for row in accuracies]
        self.budget = budget
        self.max_depth = len(accuracies) if max_depth is None else min(max_depth,
                                                                       len(accuracies))
        # _groups[(d, k)][r][n] = S(d, k, r, n); k >= 1 and d + k <= max_depth
        self._groups: dict[tuple[int, int], list[list[float]]] = {}
        for d in reversed(range(self.max_depth)):
            for k in range(1, self.max_depth - d + 1):
                self._groups[(d, k)] = self._solve_group(d, k)

    def tokens(self, nodes: int, depth: int) -> float:
        """Expected tokens of the best tree of at most `nodes` nodes and depth <= `depth`."""
        self._check_nodes(nodes)
        return 1.0 + self._value(0, self._levels(0, depth), 0, nodes)

    def tokens_table(self) -> list[list[float]]:
        """tokens_table()[n][d]: expected tokens of the best tree of at most n nodes within
        depth d, for n = 0 .. budget and d = 0 .. max_depth ((budget + 1) x (max_depth + 1))."""
        return [[self.tokens(n, d) for d in range(self.max_depth + 1)]
                for n in range(self.budget + 1)]

    def tree(self, nodes: int, depth: int) -> TreeTopology:
        """The best tree of at most `nodes` nodes within depth `depth`: the smallest of the
        optimal ones (nodes worth nothing are left out, as build_tree leaves them)."""
        self._check_nodes(nodes)
        return TreeTopology.from_choices(self._paths(0, self._levels(0, depth), 0, nodes, ()))

    def _check_nodes(self, nodes: int) -> None:
        if not 0 <= nodes <= self.budget:
            raise ValueError(f"nodes must lie in 0 .. {self.budget}, got {nodes}")

    def _levels(self, d: int, k: int) -> int:
        # Levels past the limit (or the table) add nothing: fold them onto the deepest state.
        if k < 0:
            raise ValueError(f"depth must be >= 0, got {k}")
        return min(k, self.max_depth - d)

    def _value(self, d: int, k: int, r: int, n: int) -> float:
        if n <= 0 or k <= 0 or r >= len(self.accuracies[d]):
            return 0.0
        return self._groups[(d, k)][r][n]

    def _solve_group(self, d: int, k: int) -> list[list[float]]:
        """[r][n] = S(d, k, r, n) for every rank r of depth d (a row of zeros past the last)."""
        row = self.accuracies[d]
        below = [self._value(d + 1, k - 1, 0, m) for m in range(self.budget + 1)]
        ranks = [[0.0] * (self.budget + 1) for _ in range(len(row) + 1)]
        for r in reversed(range(len(row))):
            later = ranks[r + 1]
            for n in range(1, self.budget + 1):
                ranks[r][n] = max(row[r] * (1.0 + below[m]) + later[n - 1 - m]
                                  for m in range(n))
        return ranks

    def _paths(self, d: int, k: int, r: int, n: int, parent: Choice) -> list[Choice]:
        """The choices of S(d, k, r, n)'s subtrees under `parent`: for each rank kept, its node
        and the subtree below it, the smallest split reaching the value."""
        paths: list[Choice] = []
        while n > 0 and k > 0 and r < len(self.accuracies[d]):
            value = self._value(d, k, r, n)
            if value <= self._value(d, k, r, n - 1) * (1 + _TIE):
                n -= 1  # a node fewer does as well
                continue
            a, later = self.accuracies[d][r], self._groups[(d, k)][r + 1]
            m = max(range(n), key=lambda m: (a * (1.0 + self._value(d + 1, k - 1, 0, m))
                                             + later[n - 1 - m], -m))
            path = parent + (r,)
            paths.append(path)
            paths.extend(self._paths(d + 1, k - 1, 0, m, path))
            r, n = r + 1, n - 1 - m
        return paths


def sequoia_tree(accuracies: Sequence[Sequence[float]], budget: int,
                 max_depth: int | None = None) -> TreeTopology:
    """The tree of at most `budget` nodes (root not counted) and depth <= max_depth (None: the
    table's) with the most expected tokens; accuracies[d][r] as in measured_tree.build_tree."""
    table = SequoiaTable(accuracies, budget, max_depth)
    return table.tree(budget, table.max_depth)


def sequoia_tokens(accuracies: Sequence[Sequence[float]], budget: int,
                   max_depth: int | None = None) -> list[list[float]]:
    """[n][d]: expected tokens of the best tree of at most n nodes within depth d."""
    return SequoiaTable(accuracies, budget, max_depth).tokens_table()


@dataclass(frozen=True)
class Candidate:
    """One tree a cost-aware choice weighs: `tree` verifies its size (n tokens, the root
    included) at `verify_s` = t(n), and drafting it costs `depth * draft_depth_s` more."""

    tree: TreeTopology
    tokens: float  # expected tokens per target forward, bonus included
    verify_s: float
    draft_s: float

    @property
    def step_s(self) -> float:
        return self.verify_s + self.draft_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


def candidates(table: SequoiaTable, cost: dict[int, float], draft_depth_s: float
               ) -> dict[int, list[Candidate]]:
    """{n: the distinct best trees of n - 1 nodes, one per depth limit}, for each measured
    size n (cost: {n: t(n)}) the table covers.

    A size is only a candidate with a tree of exactly n - 1 nodes (as in choose_budget: a
    smaller tree would be verified at a smaller size's cost), and a depth limit only with a
    tree that reaches it (a shallower one is the lower limit's tree). n = 1 is plain decoding:
    the root alone, no drafting.
    """
    if not cost or min(cost) < 1 or min(cost.values()) <= 0 or draft_depth_s < 0:
        raise ValueError(f"cost must map token counts n >= 1 to positive times and the draft "
                         f"cost per depth must be >= 0, got {cost}, {draft_depth_s}")
    found: dict[int, list[Candidate]] = {}
    for n in sorted(m for m in cost if m - 1 <= table.budget):
        for depth in range(0 if n == 1 else 1, table.max_depth + 1):
            tree = table.tree(n - 1, depth)
            if tree.size == n and tree.depth == depth:
                found.setdefault(n, []).append(Candidate(
                    tree, table.tokens(n - 1, depth), cost[n], depth * draft_depth_s))
    return found


def best_candidate(found: Sequence[Candidate]) -> Candidate:
    """The most expected tokens per second; ties go to the smaller, then the shallower tree."""
    if not found:
        raise ValueError("no candidate tree: no measured size has a tree of that many nodes "
                         "worth drafting")
    return max(found, key=lambda c: (c.tokens_per_s, -c.tree.size, -c.tree.depth))
