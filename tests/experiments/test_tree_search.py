"""Tree search: verification timed per size without disturbing the cache, and the command end to
end on a tiny target, its tree the one choose_budget picks from the measured costs."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments import tree_search
from experiments.common import CONF_DIR
from experiments.tree_search import load_accuracies, measure_verify_cost, time_step
from verify.target import build_tiny_model
from verify.tree import TokenTree, TreeTopology
from verify.tree_builder import build_tree, choose_budget
from verify.verifier import TreeVerifier

# 6 nodes worth drafting: size 8 (7 nodes) is measured but no candidate.
TABLE = [[0.6, 0.2], [0.5, 0.1]]


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
    assert all(layer.keys.shape[-2] == len(context) for layer in verifier.cache.layers)
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
