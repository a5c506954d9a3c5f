"""drafters.measured_tree: best-first trees from per-depth rank accuracies, the budget from
measured costs, and the written config read back as the same topology."""

import itertools

import pytest
from omegaconf import OmegaConf

from drafters.measured_tree import build_tree, choose_budget, expected_tokens, write_tree_config
from verify.tree import TreeTopology

# accuracies[d][r]: rank r of head d is right. Node values (products along the path):
# (0,) .6   (1,) .2   (0, 0) .6*.5 = .3   (0, 1) .6*.1 = .06   (1, 0) .2*.5 = .1   (1, 1) .02
TABLE = [[0.6, 0.2], [0.5, 0.1]]


def test_the_hand_worked_table():
    # Best first: (0,) .6, then (0, 0) .3 beats (1,) .2, then (1,) .2 beats (1, 0) .1 and
    # (0, 1) .06. Expected tokens: 1 (bonus) + .6 + .3 + .2 = 2.1.
    tree = build_tree(TABLE, 3)
    assert set(tree.choices) == {(0,), (0, 0), (1,)}
    assert expected_tokens(tree, TABLE) == pytest.approx(2.1)
    # The fourth node is (1, 0) .1: 2.2; all six nodes: 2.28; there are no more to add.
    assert set(build_tree(TABLE, 4).choices) == {(0,), (0, 0), (1,), (1, 0)}
    assert expected_tokens(build_tree(TABLE, 4), TABLE) == pytest.approx(2.2)
    assert expected_tokens(build_tree(TABLE, 50), TABLE) == pytest.approx(2.28)
    assert build_tree(TABLE, 0).size == 1


def test_ranks_are_filled_in_order():
    # Rank 1 alone would be filled with the best proposal (drafters close rank gaps): (1,) is
    # only a candidate once (0,) is in, however accurate it looks.
    assert build_tree([[0.1, 0.5]], 1).choices == ((0,),)
    assert build_tree([[0.1, 0.5]], 2).choices == ((0,), (1,))


def test_nodes_without_value_are_left_out():
    assert build_tree([[0.5, 0.0], [0.0]], 4).choices == ((0,),)


def test_greedy_is_the_best_tree_of_each_size():
    table = [[0.5, 0.2, 0.1], [0.4, 0.3, 0.05]]
    paths = [(r,) for r in range(3)] + list(itertools.product(range(3), range(3)))
    for size in range(1, 6):
        best = max(expected_tokens(TreeTopology.from_choices(subset), table)
                   for subset in itertools.combinations(paths, size) if _rank_closed(subset))
        assert expected_tokens(build_tree(table, size), table) == pytest.approx(best)


def _rank_closed(subset):
    # Every node's parent and next-better sibling present: what a drafter fills as drawn.
    present = set(subset) | {()}
    return all(p[:-1] in present and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in present)
               for p in subset)


def test_expected_tokens_of_a_shipped_shape():
    assert expected_tokens(TreeTopology.chain(2), TABLE) == pytest.approx(1 + 0.6 + 0.3)
    with pytest.raises(ValueError, match=r"choice \[0, 0, 0\] lies outside the accuracy table"):
        expected_tokens(TreeTopology.chain(3), TABLE)


def test_the_budget_maximises_tokens_per_unit_of_cost():
    # Budget b verifies b + 1 tokens. Tokens per step 1, 1.6, 1.9, 2.1 for budgets 0..3;
    # over t = 1.0, 1.2, 1.3, 1.8: rates 1.0, 1.333, 1.462, 1.167 -> budget 2.
    assert choose_budget(TABLE, {1: 1.0, 2: 1.2, 3: 1.3, 4: 1.8}) == 2
    # Verification twice as dear as plain decoding: 1.6 / 2 < 1, drafting does not pay.
    assert choose_budget(TABLE, {1: 1.0, 2: 2.0}) == 0
    # Only measured sizes are candidates, and a size is only the best tree of that size if the
    # table has enough nodes: 8 tokens would need 7 draft nodes, the table has 6.
    assert choose_budget(TABLE, {4: 1.0, 8: 1.0}) == 3


@pytest.mark.parametrize("cost", [{}, {0: 1.0}, {2: 0.0}])
def test_bad_costs_are_refused(cost):
    with pytest.raises(ValueError, match="cost must map"):
        choose_budget(TABLE, cost)


@pytest.mark.parametrize("table", [[[1.2]], [[-0.1]], [[0.7, 0.6]]])
def test_bad_accuracies_are_refused(table):
    with pytest.raises(ValueError, match=r"accuracies\[0\]"):
        build_tree(table, 2)


def test_a_written_config_reads_back_as_the_same_tree(tmp_path):
    # Big enough that the choices wrap over several lines.
    table = [[0.5, 0.2, 0.1, 0.05, 0.05]] + [[0.4, 0.2, 0.1, 0.05]] * 4
    tree = build_tree(table, 40)
    path = tmp_path / "built.yaml"
    write_tree_config(tree, path, "built")
    assert len(path.read_text().splitlines()) > 3
    cfg = OmegaConf.load(path)
    assert cfg.name == "built"
    assert TreeTopology.from_choices(cfg.choices) == tree
