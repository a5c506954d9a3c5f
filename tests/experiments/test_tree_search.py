"""Tree search: verification timed per size without disturbing the cache, and the command end to
end on a tiny target, its tree the one choose_budget picks from the measured costs; in sequoia
mode, Sequoia's tree beside best-first's at each size, from a file's accuracy table or one
measured by decoding; in dynamic mode, EAGLE-2's budget chosen from decoded tau, draft time and
t(n), written as a tree config."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from drafters.measured_tree import build_tree, choose_budget
from drafters.trees import tree_policy
from drafters.trees.dynamic import DynamicTree
from experiments import tree_search
from experiments.common import CONF_DIR
from experiments.results import kind_of
from experiments.tree_search import load_accuracies
from experiments.tree_search_dynamic import (
    BudgetCost,
    best_cost,
    candidate_trees,
    check_budgets,
    heldout_prompts,
    prompt_data,
    tree_shapes,
)
from experiments.tree_search_sequoia import (
    RankTally,
    complete_tree,
    format_sequoia_table,
    sequoia_rows,
)
from verify.accept import GreedyRule
from verify.costs import measure_verify_cost, time_step
from verify.runtime.model import build_tiny_model, load_target_from_config
from verify.tree import TokenTree, TreeError, TreeTopology
from verify.verifier import TreeVerifier

# 6 nodes worth drafting: size 8 (7 nodes) is measured but no candidate.
TABLE = [[0.6, 0.2], [0.5, 0.1]]
# Rank 2 beats rank 1 at depth 0: at 3 nodes best-first has 1.65 tokens, Sequoia 1.95.
GUARDED = [[0.5, 0.05, 0.4], [0.2]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama")


def test_measured_costs_are_positive_for_each_size(model):
    cost = measure_verify_cost(model, [4, 1, 2], context_len=16, repeats=2)
    assert list(cost) == [1, 2, 4] and all(t > 0 for t in cost.values())
    with_drafting = measure_verify_cost(model, [1, 2], context_len=16, repeats=1,
                                        draft_cost_s=10.0)
    assert with_drafting[1] < 10.0 < with_drafting[2]  # plain decoding drafts nothing


def test_timing_leaves_the_verifier_as_it_was(model):
    context = torch.arange(20, 40)
    verifier = TreeVerifier(model)
    verifier.prefill(context)
    assert time_step(verifier, TokenTree.from_choices(1, TreeTopology.chain(5),
                                                      [2, 3, 4, 5, 6])) > 0
    assert verifier.length == len(context)
    assert all(layer.keys.shape[-2] == len(context) for layer in verifier.state.cache.layers)
    logits, _ = verifier.verify(TokenTree(torch.tensor([7]), torch.tensor([-1])))
    with torch.no_grad():
        expected = model(torch.cat([context, torch.tensor([7])])[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_sizes_beyond_the_context_window_are_refused(model):
    with pytest.raises(ValueError, match="exceed the model's 512 positions"):
        measure_verify_cost(model, [1, 64], context_len=500)


def test_end_to_end_on_a_tiny_target(tmp_path, capsys):
    accuracies = tmp_path / "acc.json"
    accuracies.write_text(json.dumps({"rank_accuracy": TABLE}))
    out = tmp_path / "tree" / "auto.yaml"
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("tree_search", ["target=tiny_llama", f"accuracies={accuracies}",
                                      "sizes=[1,2,4,8]", "context_len=32", "repeats=2",
                                      "name=auto", f"out={out}", f"out_dir={tmp_path}"])
    tree_search.main(cfg)
    rows = json.loads((tmp_path / "tiny-llama-auto.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [1, 2, 4, 8] and rows[-1]["nodes"] == 6
    budget = choose_budget(TABLE, {r["n"]: r["t_s"] for r in rows})
    assert [r["n"] for r in rows if r["chosen"]] == [budget + 1]
    written = OmegaConf.load(out)
    assert written.name == "auto"
    assert TreeTopology.from_choices(written.choices) == build_tree(TABLE, budget)
    printed = capsys.readouterr().out
    assert "| n | nodes | t(n) ms |" in printed and "**chosen**" in printed
    assert (tmp_path / "tiny-llama-auto.png").stat().st_size > 1000  # tau and speedup by budget


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{rank_accuracy: ", "not valid JSON"),
    ('{"accuracy": [[0.5]]}', 'needs "rank_accuracy"'),
    ('{"rank_accuracy": [0.5, 0.2]}', 'needs "rank_accuracy"'),
    ('{"rank_accuracy": [[0.5, "x"]]}', 'needs "rank_accuracy"'),
    ('{"rank_accuracy": [[0.7, 0.6]]}', "must sum to at most 1"),
])
def test_a_bad_accuracies_file_is_refused(tmp_path, content, message):
    path = tmp_path / "acc.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_accuracies(path)


def test_the_accuracies_file_is_required():
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("tree_search", ["target=tiny_llama"])
    with pytest.raises(ValueError, match="set accuracies="):
        tree_search.search(cfg)


def test_sequoia_rows_set_best_first_beside_sequoia_at_each_size():
    cost = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.2}
    tree, rows = sequoia_rows(GUARDED, cost, 0.0, None)
    assert tree.choices == ((0,), (1,), (2,))
    by_n = {r["n"]: r for r in rows}
    assert by_n[4]["greedy_tokens"] == pytest.approx(1.65)
    assert by_n[4]["sequoia_tokens"] == pytest.approx(1.95) and by_n[4]["chosen"]
    assert by_n[4]["sequoia_speedup"] == pytest.approx(1.95)  # t(4) = t(1), no draft cost
    assert all(r["sequoia_best_tokens"] >= r["greedy_tokens"] - 1e-12 for r in rows)
    assert not by_n[8]["candidate"]  # 6 nodes worth drafting: no tree of 7
    assert (by_n[1]["sequoia_nodes"], by_n[1]["sequoia_speedup"]) == (0, 1.0)
    # a draft forward per depth level: both sides pay it for their own depth
    _, dear = sequoia_rows([[0.9, 0.05], [0.9, 0.05]], {1: 1.0, 3: 1.0}, 0.8, None)
    assert (dear[1]["greedy_depth"], dear[1]["sequoia_depth"]) == (2, 1)
    assert dear[1]["greedy_speedup"] == pytest.approx(2.71 / 2.6)
    assert dear[1]["sequoia_speedup"] == pytest.approx(1.95 / 1.8)
    table = format_sequoia_table(rows)
    assert "| n | t(n) ms | greedy nodes / depth |" in table
    assert "**chosen**" in table and "no candidate" in table
    with pytest.raises(ValueError, match="cost needs t\\(1\\)"):
        sequoia_rows(GUARDED, {2: 1.0}, 0.0, None)


def test_sequoia_mode_end_to_end_on_a_tiny_target(tmp_path, capsys):
    accuracies = tmp_path / "acc.json"
    accuracies.write_text(json.dumps({"rank_accuracy": GUARDED}))
    out = tmp_path / "tree" / "auto.yaml"
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("tree_search", ["target=tiny_llama", "mode=sequoia",
                                      f"accuracies={accuracies}", "sizes=[1,2,4]",
                                      "context_len=32", "repeats=2", "draft_depth_cost_s=0.0001",
                                      f"out={out}", f"out_dir={tmp_path}"])
    tree_search.main(cfg)
    report = json.loads((tmp_path / "tiny-llama-sequoia_auto.json").read_text())
    rows = report["rows"]
    assert [r["n"] for r in rows] == [1, 2, 4]
    chosen, expected = sequoia_rows(GUARDED, {r["n"]: r["t_s"] for r in rows}, 0.0001, None)
    assert [r["chosen"] for r in rows] == [r["chosen"] for r in expected]
    written = OmegaConf.load(out)
    assert written.name == "sequoia_auto" and TreeTopology.from_choices(written.choices) == chosen
    assert out.read_text().startswith("# Built by drafters.sequoia")
    printed = capsys.readouterr().out
    assert "| n | t(n) ms | greedy nodes / depth |" in printed and "**chosen**" in printed
    assert (tmp_path / "tiny-llama-sequoia_auto.png").stat().st_size > 1000
    assert kind_of(report, out).command == "experiments.tree_search mode=sequoia"


def test_the_complete_tree_offers_every_rank_at_every_depth():
    tree = complete_tree(2, 3)
    assert tree.size - 1 == 3 + 9 and all(len(tree.children(i)) == 3 for i in range(4))
    with pytest.raises(ValueError, match="measure_depth and measure_top_k must be >= 1"):
        complete_tree(0, 3)


def test_the_rank_tally_counts_the_accepted_rank_at_each_depth():
    #        0
    #      1   2
    #     3 4   5
    tree = TokenTree(torch.tensor([9, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 1, 2]))
    tally = RankTally(GreedyRule(), depth=2, top_k=2)
    tally.count(tree, [0, 2, 5])  # rank 1 at depth 0, rank 0 at depth 1, then a leaf
    tally.count(tree, [0])  # nothing accepted: depth 0 tried, depth 1 never reached
    tally.count(tree, [0, 1])  # rank 0, then node 1's children both rejected
    assert tally.reached == [3, 2] and tally.table() == [[1 / 3, 1 / 3], [0.5, 0.0]]
    assert (tally.name, tally.exact) == ("greedy", True)


@pytest.mark.parametrize("drafter", ["eagle", "recycling"])
def test_accuracies_measured_by_decoding_on_a_tiny_target(tmp_path, drafter):
    cfg = compose_dynamic(tmp_path, "mode=sequoia", "accuracies=decode", f"drafter={drafter}",
                          "measure_depth=2", "measure_top_k=2", "sizes=[1,3]", "plot=false")
    tree_search.main(cfg)
    measured = json.loads((tmp_path / "tiny-llama-sequoia_auto-rank_accuracy.json").read_text())
    assert measured["drafter"] == drafter and measured["steps"] > 0
    table = load_accuracies(tmp_path / "tiny-llama-sequoia_auto-rank_accuracy.json")
    assert [len(row) for row in table] == [2, 2]  # what a later search reads back
    rows = json.loads((tmp_path / "tiny-llama-sequoia_auto.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [1, 3] and sum(r["chosen"] for r in rows) == 1


def compose_dynamic(tmp_path, *overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("tree_search", ["target=tiny_llama", "mode=dynamic", "drafter=eagle",
                                       "budgets=[4,2]", "depth=2", "top_k=2", "num_prompts=2",
                                       "max_new_tokens=8", "context_len=16", "repeats=1",
                                       f"out={tmp_path / 'tree' / 'auto.yaml'}",
                                       f"out_dir={tmp_path}", *overrides])


def test_dynamic_mode_end_to_end_on_a_tiny_target(tmp_path, capsys):
    cfg = compose_dynamic(tmp_path)
    tree_search.main(cfg)
    rows = json.loads((tmp_path / "tiny-llama-eagle2_auto.json").read_text())["rows"]
    assert [(r["total_tokens"], r["n"]) for r in rows] == [(0, 1), (2, 3), (4, 5)]
    assert rows[0]["predicted_speedup"] == pytest.approx(1.0) and not rows[0]["chosen"]
    for r in rows[1:]:
        assert r["tau"] >= 1 and r["t_s"] > 0 and r["draft_s_per_step"] > 0
        assert 1 < r["mean_tree_size"] <= r["n"]
        # the loop's own time is charged beside t(n) and the draft's, from the same decoding
        assert 0 < r["loop_s_per_step"] < r["t_s"] + r["draft_s_per_step"]
        assert r["predicted_tokens_per_s"] == pytest.approx(
            r["tau"] / (r["t_s"] + r["draft_s_per_step"] + r["loop_s_per_step"]))
        assert r["decoded_tokens_per_s"] > 0  # what its decoding ran at, beside the prediction
    chosen = best_cost([BudgetCost(r["total_tokens"], r["tau"], r["t_s"],
                                   r["draft_s_per_step"], loop_s=r["loop_s_per_step"])
                        for r in rows[1:]]).budget
    assert [r["total_tokens"] for r in rows if r["chosen"]] == [chosen]
    written = OmegaConf.load(tmp_path / "tree" / "auto.yaml")
    assert written.name == "eagle2_auto"
    assert tree_policy(written) == DynamicTree(depth=2, top_k=2, total_tokens=chosen)
    header = (tmp_path / "tree" / "auto.yaml").read_text().split("\nname:")[0]
    assert "mode=dynamic on tiny-llama (float32, cpu" in header.replace("\n# ", " ")
    printed = capsys.readouterr().out
    assert "| total_tokens | t(n) ms | draft ms/step | loop ms/step | tau |" in printed
    assert "plain decoding" in printed and "**chosen**" in printed


def test_the_best_predicted_tokens_per_second_is_chosen():
    costs = [BudgetCost(4, tau=2.0, verify_s=0.010, draft_s=0.002),   # 166.7 tokens/s
             BudgetCost(8, tau=2.6, verify_s=0.012, draft_s=0.003),   # 173.3
             BudgetCost(16, tau=2.8, verify_s=0.020, draft_s=0.004)]  # 116.7
    assert best_cost(costs).budget == 8
    # a cheaper draft step tips the balance towards the bigger tree
    assert best_cost(costs[:2] + [BudgetCost(16, 2.8, 0.012, 0.002)]).budget == 16
    # ties go to the smaller budget, whatever the order, then to the smaller shape
    assert best_cost([BudgetCost(8, 2.0, 0.01, 0.0), BudgetCost(4, 2.0, 0.01, 0.0)]).budget == 4
    wide, narrow = BudgetCost(4, 2.0, 0.01, 0.0, 3, 8), BudgetCost(4, 2.0, 0.01, 0.0, 3, 4)
    assert best_cost([wide, narrow]) == narrow


def test_tree_shapes_cross_every_depth_with_every_top_k():
    assert tree_shapes(3, 4) == [(3, 4)]
    assert tree_shapes([3, 2, 3], [8, 4]) == [(2, 4), (2, 8), (3, 4), (3, 8)]
    with pytest.raises(ValueError, match="top_k must be an integer or a non-empty list"):
        tree_shapes(3, [])


def test_candidate_trees_measure_each_distinct_tree_once(capsys):
    trees = candidate_trees([1, 4, 8], tree_shapes([2, 5], [2, 4]))
    # budget 1 grows one round whatever the depth; depth 5 at budget 4 is depth 4;
    # depth 2 and top_k 2 propose only 6 candidates, too few for 8
    assert [(t.depth, t.top_k, t.total_tokens) for t in trees] == [
        (1, 2, 1), (1, 4, 1), (2, 2, 4), (2, 4, 4), (4, 2, 4), (4, 4, 4),
        (2, 4, 8), (5, 2, 8), (5, 4, 8)]
    assert trees[DynamicTree(1, 4, 1)] == [(2, 4), (5, 4)]  # the shapes asked it stands for
    assert trees[DynamicTree(4, 2, 4)] == [(5, 2)]
    assert "budget 8: skipped for (depth, top_k) [(2, 2)]" in capsys.readouterr().out
    with pytest.raises(ValueError, match="budget 21 exceeds the 20 candidates depth 2 and top_k 4"):
        candidate_trees([21], tree_shapes(2, [2, 4]))


def test_dynamic_mode_chooses_the_shape_with_the_budget(tmp_path, capsys):
    cfg = compose_dynamic(tmp_path, "depth=[1,2]", "top_k=[2,3]", "budgets=[2]")
    tree_search.main(cfg)
    rows = json.loads((tmp_path / "tiny-llama-eagle2_auto.json").read_text())["rows"]
    measured = [(r["depth"], r["top_k"], r["total_tokens"]) for r in rows[1:]]
    assert measured == [(1, 2, 2), (1, 3, 2), (2, 2, 2), (2, 3, 2)]
    assert (rows[0]["depth"], rows[0]["top_k"]) == (None, None)  # plain decoding
    # depths 1 and 2 both fit a 2-node budget: each tree stands for its own shape
    assert [r["shapes"] for r in rows[1:]] == [[[1, 2]], [[1, 3]], [[2, 2]], [[2, 3]]]
    best = next(r for r in rows if r["chosen"])
    assert best["predicted_tokens_per_s"] == max(r["predicted_tokens_per_s"] for r in rows[1:])
    written = OmegaConf.load(tmp_path / "tree" / "auto.yaml")
    assert tree_policy(written) == DynamicTree(best["depth"], best["top_k"], 2)
    assert "| - | - | 0 |" in capsys.readouterr().out  # the plain row has no shape
    assert (tmp_path / "tiny-llama-eagle2_auto.png").stat().st_size > 1000


def test_dynamic_mode_refuses_a_drafter_without_dynamic_trees(tmp_path):
    cfg = compose_dynamic(tmp_path, "drafter=prompt_lookup")
    with pytest.raises(TreeError, match="drafter=prompt_lookup cannot grow"):
        tree_search.main(cfg)
    assert not (tmp_path / "tree").exists()


@pytest.mark.parametrize("budgets, message", [
    ([], "non-empty list of integers >= 1"),
    ([0, 4], "non-empty list of integers >= 1"),
    ([2, True], "non-empty list of integers >= 1"),
    ([4, 7], "budget 7 exceeds the 6 candidates"),  # depth 2, top_k 2: 2 + 2 x 2
])
def test_bad_budgets_are_refused(budgets, message):
    with pytest.raises(ValueError, match=message):
        check_budgets(budgets, depth=2, top_k=2)
    assert check_budgets([6, 2, 6], depth=2, top_k=2) == [2, 6]
    with pytest.raises(ValueError, match="DynamicTree.depth must be an integer >= 1"):
        check_budgets([4], depth=0, top_k=2)


def test_only_held_out_prompts_are_decoded(tmp_path):
    cfg = compose_dynamic(tmp_path)
    target = load_target_from_config(cfg.target)
    first = heldout_prompts(cfg.data, target, 2)
    assert len(first) == 2 and all(len(ids) <= cfg.data.max_prompt_tokens for ids in first)
    assert all(torch.equal(a, b) for a, b in zip(first, heldout_prompts(cfg.data, target, 3)))
    with pytest.raises(ValueError, match="later prompts are trained on"):
        heldout_prompts(cfg.data, target, cfg.data.heldout_prompts + 1)


def test_a_drafter_without_training_data_decodes_self_distillations_held_out_prompts(tmp_path):
    suffix = compose_dynamic(tmp_path, "drafter=suffix")
    assert suffix.data is None  # nothing to train: no conf/data/default/suffix.yaml
    medusa = compose_dynamic(tmp_path, "drafter=medusa")  # trains on self_distill
    assert prompt_data(medusa) is medusa.data
    assert OmegaConf.to_container(prompt_data(suffix)) == OmegaConf.to_container(medusa.data)
    chosen = compose_dynamic(tmp_path, "drafter=suffix", "data=sharegpt")
    assert prompt_data(chosen).name == "sharegpt"


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode must be static .* or dynamic"):
        tree_search.main(compose_dynamic(tmp_path, "mode=beam"))


UNORDERED = [[0.3, 0.05, 0.6], [0.9]]  # rank 2 right more often than rank 1 at depth 0


def test_static_mode_says_when_its_best_first_tree_is_not_the_best(monkeypatch, caplog):
    """Best first builds 1.62 expected tokens with 3 nodes where Sequoia's DP builds 1.95:
    the static search warns and names mode=sequoia; an ordered table gives no warning."""
    from drafters.measured_tree import expected_tokens
    from drafters.sequoia import sequoia_tree

    assert expected_tokens(build_tree(UNORDERED, 3), UNORDERED) == pytest.approx(1.62)
    assert expected_tokens(sequoia_tree(UNORDERED, 3), UNORDERED) == pytest.approx(1.95)
    cost = {1: 1.0, 4: 1.0}
    for table, warned in ((UNORDERED, True), (TABLE, False)):
        caplog.clear()
        monkeypatch.setattr(tree_search, "table_and_costs", lambda cfg, t=table: (t, cost))
        tree_search.search(OmegaConf.create({}))
        assert ("(depth, rank) [(0, 2)]: the best-first tree of a size is then not the best; "
                "mode=sequoia" in caplog.text) is warned


def test_a_rank_accuracy_counted_over_few_steps_gets_a_warning(tmp_path, caplog):
    path = tmp_path / "measured-rank_accuracy.json"
    path.write_text(json.dumps({"rank_accuracy": TABLE, "steps": 12}))
    load_accuracies(path)
    assert f"rank accuracy in {path} was counted over 12 decoding steps (< 100)" in caplog.text
    caplog.clear()
    path.write_text(json.dumps({"rank_accuracy": TABLE, "steps": 500}))
    load_accuracies(path)
    assert caplog.text == ""
