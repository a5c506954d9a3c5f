"""The per-step size rule on hand-set costs and scores, its cost sources, and EAGLE-2's
dynamic tree sized by it."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from drafters.trees.cost import StepCost, best_size, cut_to_cost, measured_cost, step_cost
from drafters.trees.dynamic import DynamicTree
from experiments.common import CONF_DIR
from verify.tree import TokenTree, TreeBuilder, TreeError


def test_interpolation_between_and_past_the_measured_sizes():
    cost = StepCost({1: 10.0, 4: 16.0, 8: 24.0})
    assert cost.t(1) == 10 and cost.t(2) == pytest.approx(12.0) and cost.t(6) == pytest.approx(20)
    assert cost.t(10) == pytest.approx(28.0)  # the last slope, 2 ms a token
    assert StepCost({1: 10.0}).t(5) == 10.0


def test_a_node_is_kept_while_it_raises_tokens_per_ms():
    cost = StepCost({1: 10.0, 2: 12.0, 3: 14.0, 4: 16.0, 5: 18.0})
    # 1 + 0.9 over 12 ms beats 1 over 10; + 0.5 more: 2.4 / 14 beats 1.9 / 12; + 0.1: no
    assert best_size([0.9, 0.5, 0.1], cost) == 2
    assert best_size([0.1, 0.05], cost) == 0  # not worth 2 ms: decode plainly
    assert best_size([], cost) == 0


def test_the_argmax_looks_past_a_bump_a_marginal_rule_would_stop_at():
    bumpy = StepCost({1: 10.0, 2: 14.0, 3: 11.0, 4: 11.5})
    assert best_size([0.3, 0.3, 0.3], bumpy) == 3  # t(2) is a measured bump


def test_draft_time_counts_in_the_rate():
    cost = StepCost({1: 10.0, 2: 11.0}, draft_ms=2.0)
    assert best_size([0.1], cost, draft_forwards=0) == 0
    assert best_size([0.3], cost, draft_forwards=1) == 1  # 1.3 / 13 > 1 / 12


def test_cut_keeps_the_best_nodes_parents_first_and_refuses_a_tree_without_scores():
    tree = TokenTree([5, 6, 7, 8], [-1, 0, 1, 0], scores=torch.tensor([1.0, 0.8, 0.6, 0.1]))
    cut = cut_to_cost(tree, StepCost({1: 10.0, 2: 10.5, 3: 11.0, 4: 30.0}))
    assert cut.tokens.tolist() == [5, 6, 7] and cut.parents.tolist() == [-1, 0, 1]
    with pytest.raises(TreeError, match="needs node scores"):
        cut_to_cost(TokenTree([5, 6], [-1, 0]), StepCost({1: 1.0}))


def test_costs_from_a_config_a_file_or_none(tmp_path):
    assert step_cost(None) is None
    assert step_cost({"t_ms": {1: 10, 2: 12}, "draft_ms": 1.5}).t(2) == 12
    path = tmp_path / "search.json"
    path.write_text(json.dumps({"rows": [{"n": 1, "t_s": 0.05}, {"n": 4, "t_s": 0.08}]}))
    assert step_cost({"file": str(path)}).t(4) == pytest.approx(80.0)
    with pytest.raises(ValueError, match="needs t_ms"):
        step_cost({"draft_ms": 1.0, "measure": False})
    with pytest.raises(ValueError, match="t\\(1\\) among them"):
        StepCost({2: 10.0})


def adaptive_tree(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("bench", ["drafter=suffix", "tree=adaptive", *overrides]).tree


def test_a_given_cost_is_used_and_measure_true_beside_it_is_refused(tmp_path):
    not_a_model = object()  # measuring would fail on it: nothing may be measured here
    given = measured_cost(adaptive_tree("tree.cost.t_ms={1:10,8:12}"), not_a_model)
    assert step_cost(given.cost).t(8) == 12
    with pytest.raises(ValueError, match="costs file /nonexistent.json does not exist"):
        step_cost(measured_cost(adaptive_tree("tree.cost.file=/nonexistent.json"),
                                not_a_model).cost)
    with pytest.raises(ValueError, match="measure=true would replace the given tree.cost.t_ms"):
        measured_cost(adaptive_tree("tree.cost.measure=true", "tree.cost.t_ms={1:10}"),
                      not_a_model)
    with pytest.raises(ValueError, match="t_ms and tree.cost.file are both given"):
        measured_cost(adaptive_tree("tree.cost.t_ms={1:10}", "tree.cost.file=x.json"),
                      not_a_model)
    with pytest.raises(ValueError, match="tree.cost.measure must be true, false or null"):
        measured_cost(adaptive_tree("tree.cost.measure=abc"), not_a_model)


@pytest.mark.parametrize("t_ms, refused", [
    ("abc", r"tree\.cost\.t_ms must map token counts"),
    ([1.0, -2.0], r"tree\.cost\.t_ms must map token counts"),
    ({1: -5, 2: "abc"}, r"tree\.cost\.t_ms\[1\] must be > 0 ms, got -5"),
    ({1: 5, 2: "abc"}, r"tree\.cost\.t_ms\[2\] must be a number of milliseconds, got 'abc'"),
    ({"x": 5}, r"tree\.cost\.t_ms: key 'x' is not a token count"),
    ({0: 5}, r"key 0 is not a token count")])
def test_a_malformed_cost_names_its_key(t_ms, refused):
    with pytest.raises(ValueError, match=refused):
        step_cost({"measure": False, "t_ms": t_ms})
    with pytest.raises(ValueError, match=r"tree\.cost\.draft_ms must be a number"):
        step_cost({"t_ms": {1: 10}, "draft_ms": "abc"})
    with pytest.raises(ValueError, match=r"tree\.cost\.draft_ms must be >= 0"):
        step_cost({"t_ms": {1: 10}, "draft_ms": -1})


def test_measure_true_times_the_target_once(tiny):
    tree = measured_cost({"depth": 2, "cost": {"measure": True, "draft_ms": 1.0}},
                         tiny("llama").model)
    assert set(tree["cost"]["t_ms"]) >= {1, 2, 4} and tree["cost"]["draft_ms"] == 1.0
    assert "measure" not in tree["cost"]
    unchanged = {"depth": 2}
    assert measured_cost(unchanged, tiny("llama").model) is unchanged


def candidates() -> TreeBuilder:
    tree = TreeBuilder(root=0, scored=True)
    a = tree.add(0, 1, -0.1)   # p 0.90
    tree.add(0, 2, -2.3)       # p 0.10
    tree.add(a, 3, -0.5)       # p 0.61 (scores are cumulative)
    return tree


def test_the_dynamic_tree_keeps_only_nodes_that_pay():
    flat = DynamicTree(2, 2, 3, cost=StepCost({1: 10.0, 4: 10.0}))
    assert flat.rerank(candidates()) == [0, 1, 2, 3]
    steep = DynamicTree(2, 2, 3, cost=StepCost({1: 10.0, 2: 12.0, 3: 15.0, 4: 30.0}))
    # 1.9 / 12 < 2.51 / 15 > 2.61 / 30: the two best nodes (p 0.9 and 0.61)
    assert steep.rerank(candidates()) == [0, 1, 3]
    assert DynamicTree(2, 2, 3).rerank(candidates()) == [0, 1, 2, 3]  # no cost: the budget
    kept = steep.rerank(candidates())
    assert candidates().build(kept).scores.tolist() == pytest.approx([1.0, 0.905, 0.607],
                                                                       abs=1e-3)


def test_a_round_runs_only_while_its_best_candidate_pays_for_a_draft_forward():
    calls = []

    def expand(tree, nodes):
        calls.append(nodes)
        return torch.full((len(nodes), 4), -5.0)  # every child unlikely

    root = torch.tensor([-0.1, -3.0, -5.0, -5.0])
    free = DynamicTree(4, 1, 4, cost=StepCost({1: 10.0}, draft_ms=0.0))
    free.search(0, root, expand)
    assert len(calls) == 3  # every round of depth 4
    calls.clear()
    dear = DynamicTree(4, 1, 4, cost=StepCost({1: 10.0}, draft_ms=5.0))
    dear.search(0, root, expand)  # round 2's best is p 0.9: pays; round 3's p 0.006: not
    assert len(calls) == 1
