"""Static trees built from measured acceptance, sized by the measured cost of verification.

Medusa's sparse trees and Sequoia's size choice, in one place. A drafter whose rank-r proposal at
depth d is right with probability `accuracies[d][r]` (measured on held-out data: top-(r+1) minus
top-r accuracy of head d) accepts a node with probability the product of those accuracies along
its path, if the depths are treated as independent. The expected tokens per target forward are
then 1 (the bonus token) plus the sum of the nodes' values, and adding nodes best first gives
the tree of each size that maximises it, as long as each depth's accuracies fall with rank
(`rank_order_breaks`: else Sequoia's dynamic programming, drafters.sequoia, finds the best).
With t(n) the measured cost of verifying n tokens, the size to ship maximises expected tokens
per unit of cost.
"""

from __future__ import annotations

import heapq
import json
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from verify.runtime.files import write_text
from verify.tree import TreeTopology

Choice = tuple[int, ...]  # ranks from the root, as in TreeTopology.choices


def build_tree(accuracies: Sequence[Sequence[float]], budget: int) -> TreeTopology:
    """The tree of at most `budget` nodes (root not counted) with the most expected tokens
    (best first: the best where no `rank_order_breaks`).

    accuracies[d][r]: probability that the rank-r proposal at depth d (0-based; Medusa head d)
    is the correct token. Fewer nodes come back when no candidate is left with a positive value.
    """
    return TreeTopology.from_choices([path for path, _ in _greedy_nodes(accuracies, budget)])


def expected_tokens(topology: TreeTopology, accuracies: Sequence[Sequence[float]]) -> float:
    """Expected tokens per target forward for `topology`: 1 + the sum of its nodes' values."""
    _check_table(accuracies)
    return 1.0 + sum(_value(path, accuracies) for path in topology.choices)


def rank_order_breaks(accuracies: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """(depth, rank) wherever rank r is right more often than rank r - 1. Adding nodes best
    first then misses the best tree of some sizes: a node worth more waits behind its worse
    next-better sibling (accuracies [0.3, 0.05, 0.6]: 3 nodes of depth 1 expect 0.95 tokens,
    best first builds 0.62)."""
    return [(d, r) for d, row in enumerate(accuracies) for r in range(1, len(row))
            if row[r] > row[r - 1]]


def choose_budget(accuracies: Sequence[Sequence[float]], cost: dict[int, float]) -> int:
    """The node budget whose best tree maximises expected tokens / t(budget + 1).

    cost: {n: t(n)}, the measured time of one step verifying n tokens (the root included; add
    drafting time where it matters). Only measured sizes are candidates; 0 (plain decoding)
    is one when t(1) is given. Ties go to the smaller budget.
    """
    if not cost or min(cost) < 1 or min(cost.values()) <= 0:
        raise ValueError(f"cost must map token counts n >= 1 to positive times, got {cost}")
    order = _greedy_nodes(accuracies, max(cost) - 1)
    tokens = [1.0]  # tokens[b]: expected tokens of the best tree of b nodes
    for _, value in order:
        tokens.append(tokens[-1] + value)
    # A size beyond the nodes worth adding would verify a smaller tree: not that size's tree.
    sizes = [n for n in sorted(cost) if n - 1 < len(tokens)]
    if not sizes:
        raise ValueError(f"no measured size fits: the table has {len(order)} nodes worth "
                         f"drafting, the smallest size measured is {min(cost)}")
    best = max(sizes, key=lambda n: tokens[n - 1] / cost[n])
    return best - 1


def write_tree_config(topology: TreeTopology, path: str | Path, name: str,
                      builder: str = "drafters.measured_tree") -> None:
    """Write `topology` as a conf/tree YAML (`name` and Medusa-style `choices`); the header
    names the module that built it."""
    choices = json.dumps([list(c) for c in topology.choices])
    # Flow lists wrapped like the shipped configs: a break inside brackets is plain whitespace.
    body = textwrap.fill(f"choices: {choices}", width=100, subsequent_indent=" " * 10,
                         break_long_words=False, break_on_hyphens=False)
    header = (f"# Built by {builder} from measured accuracies: {topology.size - 1} "
              f"nodes, depth {topology.depth}.")
    write_text(Path(path), f"{header}\nname: {name}\n{body}\n")  # whole or not at all


def _greedy_nodes(accuracies: Sequence[Sequence[float]], budget: int) -> list[tuple[Choice, float]]:
    """Up to `budget` (path, value) pairs, best first; each prefix is the best tree of its size.

    A candidate needs its parent and its next-better sibling in the tree: drafters fill ranks
    in order, so rank r without rank r - 1 would be filled with the rank r - 1 proposal. Each
    added node makes two candidates, its first child and its next sibling, so every node is
    queued once and the heap stays small.
    """
    _check_table(accuracies)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    heap: list[tuple[float, int, Choice]] = []
    _push(heap, (0,), accuracies)
    nodes = []
    while heap and len(nodes) < budget:
        negative, _, path = heapq.heappop(heap)
        nodes.append((path, -negative))
        _push(heap, path + (0,), accuracies)
        _push(heap, path[:-1] + (path[-1] + 1,), accuracies)
    return nodes


def _push(heap: list, path: Choice, accuracies: Sequence[Sequence[float]]) -> None:
    # Outside the table or worthless: never a candidate. Ties: shallower, then lower ranks.
    depth = len(path) - 1
    if depth < len(accuracies) and path[-1] < len(accuracies[depth]):
        value = _value(path, accuracies)
        if value > 0:
            heapq.heappush(heap, (-value, len(path), path))


def _value(path: Choice, accuracies: Sequence[Sequence[float]]) -> float:
    """Probability that every token on `path` is accepted (product over its depths)."""
    if len(path) > len(accuracies) or any(r >= len(accuracies[d]) for d, r in enumerate(path)):
        raise ValueError(f"choice {list(path)} lies outside the accuracy table "
                         f"({[len(row) for row in accuracies]} ranks per depth)")
    return math.prod(accuracies[d][r] for d, r in enumerate(path))


def _check_table(accuracies: Sequence[Sequence[float]]) -> None:
    for d, row in enumerate(accuracies):
        if any(not 0 <= a <= 1 for a in row) or sum(row) > 1 + 1e-6:
            raise ValueError(f"accuracies[{d}] = {list(row)}: each must lie in [0, 1] and they "
                             "must sum to at most 1 (rank r's share of the top-k accuracy)")
