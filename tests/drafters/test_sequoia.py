"""Sequoia's DP: the best tree of every size and depth limit (checked against enumerating every
valid tree), never worse than best-first, better where a weak rank guards a strong one, and the
(size, depth) choice that weighs a draft forward per depth level."""

import itertools
import random

import pytest

from drafters.measured_tree import build_tree, expected_tokens
from drafters.sequoia import SequoiaTable, best_candidate, candidates, sequoia_tokens, sequoia_tree
from verify.tree import TreeTopology

# Rank 2 beats rank 1 at depth 0: best-first takes (0, 0) (.1) and (1,) (.05) after (0,),
# Sequoia spends (1,) to reach (2,) (.4).
GUARDED = [[0.5, 0.05, 0.4], [0.2]]


def _valid(choices, max_depth):
    """Every node's parent and next-better sibling present, within the depth limit."""
    present = set(choices) | {()}
    return all(len(p) <= max_depth and p[:-1] in present
               and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in present) for p in choices)


def _every_tree(ranks, max_depth, budget):
    """Every valid tree of at most `budget` nodes over `ranks` per depth (list of choices)."""
    paths = [p for d in range(1, len(ranks) + 1)
             for p in itertools.product(*(range(r) for r in ranks[:d]))]
    return [subset for size in range(budget + 1)
            for subset in itertools.combinations(paths, size) if _valid(subset, max_depth)]


def _random_table(rng, ranks, monotone):
    table = []
    for r in ranks:
        row = [rng.random() for _ in range(r)]
        row = [a / sum(row) * rng.uniform(0.3, 1.0) for a in row]  # a share of a top-k hit
        table.append(sorted(row, reverse=True) if monotone else row)
    return table


@pytest.mark.parametrize("seed", range(6))
def test_the_dp_is_the_best_of_every_valid_tree(seed):
    rng = random.Random(seed)
    table = _random_table(rng, [3, 3], monotone=seed % 2 == 0)
    trees = {depth: _every_tree([3, 3], depth, 6) for depth in (0, 1, 2)}
    dp = SequoiaTable(table, 6)
    for depth, budget in itertools.product((0, 1, 2), range(7)):
        best = max(expected_tokens(TreeTopology.from_choices(t), table)
                   for t in trees[depth] if len(t) <= budget)
        assert dp.tokens(budget, depth) == pytest.approx(best, abs=1e-12)
        tree = dp.tree(budget, depth)
        assert expected_tokens(tree, table) == pytest.approx(best, abs=1e-12)
        assert tree.size - 1 <= budget and tree.depth <= depth and _valid(tree.choices, depth)
    assert sequoia_tokens(table, 6) == dp.tokens_table()


def test_the_dp_never_loses_to_best_first_and_ties_it_on_monotone_tables():
    rng = random.Random(7)
    for trial in range(20):
        monotone = trial % 2 == 0
        table = _random_table(rng, [4, 3, 3], monotone)
        for budget in (1, 3, 8, 20):
            greedy = expected_tokens(build_tree(table, budget), table)
            dp = expected_tokens(sequoia_tree(table, budget), table)
            assert dp >= greedy - 1e-12
            if monotone:  # a child never beats its parent nor a rank its better one
                assert dp == pytest.approx(greedy, abs=1e-12)


def test_a_weak_rank_guarding_a_strong_one_beats_best_first():
    assert expected_tokens(build_tree(GUARDED, 3), GUARDED) == pytest.approx(1.65)
    tree = sequoia_tree(GUARDED, 3)
    assert tree.choices == ((0,), (1,), (2,))
    assert expected_tokens(tree, GUARDED) == pytest.approx(1.95)
    # A worthless rank 0 is no candidate for best-first at all; Sequoia keeps it for rank 1.
    assert build_tree([[0.0, 0.5]], 2).choices == ()
    assert sequoia_tree([[0.0, 0.5]], 2).choices == ((0,), (1,))


def test_the_depth_limit_and_the_budget_hold():
    table = [[0.8, 0.1]] * 4
    assert sequoia_tree(table, 4).choices == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    shallow = sequoia_tree(table, 4, max_depth=2)
    assert shallow.depth == 2 and shallow.size == 5 and _valid(shallow.choices, 2)
    tokens = sequoia_tokens(table, 4, max_depth=2)
    assert len(tokens) == 5 and all(len(row) == 3 for row in tokens)
    assert all(row[0] == 1.0 for row in tokens)  # depth 0: the bonus token alone
    assert tokens[4][2] == pytest.approx(expected_tokens(shallow, table))
    # more nodes or more depth never hurt
    assert all(tokens[n][d] <= tokens[n + 1][d] and tokens[n][d] <= tokens[n][d + 1]
               for n in range(4) for d in range(2))
    # the smallest optimal tree: nodes worth nothing are left out, as best-first leaves them
    assert sequoia_tree([[0.5, 0.0], [0.0]], 4).choices == ((0,),)
    assert sequoia_tree(table, 0).size == 1


def test_a_dear_draft_forward_per_depth_picks_a_shallower_tree():
    # Two nodes (n = 3) at t(3) = t(1): the chain .9 + .81 = 2.71 tokens against the pair
    # .9 + .05 = 1.95. Free drafting: the chain. At .8 per depth level: 2.71 / 2.6 = 1.04
    # per unit of time against 1.95 / 1.8 = 1.08 for the pair, and 1.0 for plain decoding.
    table, cost = [[0.9, 0.05], [0.9, 0.05]], {1: 1.0, 3: 1.0}
    dp = SequoiaTable(table, 2)
    free = best_candidate([c for cs in candidates(dp, cost, 0.0).values() for c in cs])
    assert free.tree.choices == ((0,), (0, 0)) and free.tokens == pytest.approx(2.71)
    dear = best_candidate([c for cs in candidates(dp, cost, 0.8).values() for c in cs])
    assert dear.tree.choices == ((0,), (1,)) and dear.step_s == pytest.approx(1.8)
    # dearer still: speculation no longer pays
    assert best_candidate([c for cs in candidates(dp, cost, 2.0).values() for c in cs]
                          ).tree.size == 1


def test_only_sizes_with_that_many_nodes_worth_drafting_are_candidates():
    dp = SequoiaTable([[0.5, 0.0]], 7)  # one node worth drafting
    found = candidates(dp, {1: 1.0, 2: 1.0, 4: 1.0}, 0.0)
    assert sorted(found) == [1, 2] and [c.tree.depth for c in found[1]] == [0]


@pytest.mark.parametrize("budget, depth", [(-1, None), (2, -1)])
def test_bad_limits_are_refused(budget, depth):
    with pytest.raises(ValueError, match="budget and max_depth must be >= 0"):
        SequoiaTable(GUARDED, budget, depth)


def test_bad_costs_and_tables_are_refused():
    dp = SequoiaTable(GUARDED, 2)
    with pytest.raises(ValueError, match="cost must map"):
        candidates(dp, {0: 1.0}, 0.0)
    with pytest.raises(ValueError, match="cost must map"):
        candidates(dp, {1: 1.0}, -0.1)
    with pytest.raises(ValueError, match=r"accuracies\[0\]"):
        SequoiaTable([[0.7, 0.6]], 2)
    with pytest.raises(ValueError, match="nodes must lie in 0 .. 2"):
        dp.tree(3, 1)
