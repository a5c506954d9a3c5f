"""Token Recycling (drafters.recycling): the table the target's predictions write, the trees
grown from it, and the memory protocol a benchmark relies on. Greedy identity on every target
and step is the drafter table's (test_drafter_table.py)."""

import dataclasses
import json
import math

import pytest
import torch

from drafters.recycling import RecyclingConfig, RecyclingDrafter, RecyclingTable, from_config
from drafters.suffix import from_config as suffix_from_config
from drafters.trees.dynamic import DynamicTree
from verify.accept import Acceptance
from verify.loop import generate
from verify.predictions import TargetPredictions
from verify.protocol import DraftContext
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeError, TreeTopology

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


def context(tokens):
    return DraftContext(torch.tensor(tokens), None, SamplingParams())


def predictions(ids, logprobs, verified=None):
    ids = torch.tensor(ids)
    verified = (torch.ones(len(ids), dtype=torch.bool) if verified is None
                else torch.tensor(verified))
    return TargetPredictions(ids, torch.tensor(logprobs, dtype=torch.float32), verified)


def taught(drafter, tree, path, ids, logprobs, verified=None):
    """Tell `drafter` the target verified `tree`, accepting `path`, predicting `ids` after
    its nodes."""
    drafter.update(tree, Acceptance(path, 0, predictions(ids, logprobs, verified)))


def test_every_verified_node_writes_its_row_and_the_tree_follows_the_table():
    drafter = RecyclingDrafter(DynamicTree(depth=3, top_k=2, total_tokens=8),
                               RecyclingConfig(top_k=2))
    drafter.begin(torch.tensor([1]))
    # a verified tree 5 -> {6, 7}; the target's top-2 after each of its nodes
    tree = TokenTree([5, 6, 7], [-1, 0, 0])
    taught(drafter, tree, [0, 1], [[6, 7], [8, 9], [10, 11]],
           [[LOG_HALF, LOG_QUARTER], [LOG_HALF, LOG_QUARTER], [LOG_HALF, LOG_HALF]])
    # the rejected node 7 taught its successors too
    assert drafter.successors(7) == ((10, 11), (pytest.approx(LOG_HALF),) * 2)
    grown = drafter.propose(context([1, 5]))
    # best first by the product of recorded probabilities (ties: the shallower first): 6 (.5),
    # 7 (.25), 8 (.25, under 6), 9, 10 and 11 (.125 each); 8 to 11 have no successors yet
    assert grown.tokens.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert grown.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert grown.scores.tolist() == pytest.approx([1, .5, .25, .25, .125, .125, .125])
    assert grown.draft_probs is None  # deterministic children: exact for sampling too


def test_an_unknown_root_drafts_nothing_and_unverified_rows_are_not_recorded():
    drafter = RecyclingDrafter(DynamicTree(3, 2, 8), RecyclingConfig(top_k=2))
    drafter.begin(torch.tensor([1]))
    assert len(drafter.propose(context([1, 5]))) == 1
    # a hybrid member's node that the merged tree left out: row -1 / -inf, verified False
    taught(drafter, TokenTree([5, 6], [-1, 0]), [0], [[6, 7], [-1, -1]],
           [[0.0, -1.0], [-math.inf, -math.inf]], verified=[True, False])
    assert drafter.successors(6) is None and drafter.successors(5) is not None


def test_where_a_token_occurs_twice_the_accepted_node_writes_last():
    drafter = RecyclingDrafter(DynamicTree(3, 1, 8), RecyclingConfig(top_k=1))
    drafter.begin(torch.tensor([1]))
    tree = TokenTree([5, 9, 6, 9], [-1, 0, 0, 2])  # token 9 twice: node 3 on the accepted path
    taught(drafter, tree, [0, 2, 3], [[9], [40], [9], [41]], [[0.0], [0.0], [0.0], [0.0]])
    assert drafter.successors(9)[0] == (41,)


def test_the_template_is_filled_breadth_first_by_rank_and_pruned_where_unknown():
    topology = TreeTopology.from_choices([[0], [1], [0, 0], [0, 1], [1, 0]])
    drafter = RecyclingDrafter(topology, RecyclingConfig(top_k=2))
    drafter.begin(torch.tensor([1]))
    drafter.table.rows = {5: ((6, 7), (LOG_HALF, LOG_QUARTER)), 6: ((8,), (0.0,))}
    tree = drafter.propose(context([1, 5]))
    # 6's rank-1 successor does not exist, 7 has no row: [0, 1] and [1, 0] are left out
    assert tree.tokens.tolist() == [5, 6, 7, 8]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.scores.tolist() == pytest.approx([1, .5, .25, .5])


def test_a_tree_wider_than_the_table_is_refused():
    with pytest.raises(TreeError, match="rank 2 successors .* top_k=2"):
        RecyclingDrafter(TreeTopology.from_choices([[0], [1], [2]]), RecyclingConfig(top_k=2))
    with pytest.raises(TreeError, match="tree.top_k=4 .* drafter.top_k=2"):
        RecyclingDrafter(DynamicTree(3, 4, 8), RecyclingConfig(top_k=2))
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        RecyclingDrafter(DynamicTree(3, 1, 8), RecyclingConfig(top_k=0))


def test_a_requests_rows_join_the_shared_table_when_the_next_begins_and_forks_share_it():
    drafter = RecyclingDrafter(DynamicTree(3, 1, 4), RecyclingConfig(top_k=1))
    twin = drafter.fork()
    drafter.begin(torch.tensor([1]))
    twin.begin(torch.tensor([2]))
    taught(drafter, TokenTree([5], [-1]), [0], [[6]], [[0.0]])
    assert twin.successors(5) is None  # the row decoding beside it does not see it
    assert drafter.table.rows == {}
    drafter.begin(torch.tensor([3]))
    assert drafter.table.rows == {5: ((6,), (0.0,))} and twin.table is drafter.table
    assert twin.successors(5) == ((6,), (0.0,))  # shared now: the writer's request ended


def test_a_repeated_prompt_reproduces_its_first_run_after_forget_and_not_without(tiny):
    model = tiny("llama").model
    prompt = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44])
    drafter = RecyclingDrafter(DynamicTree(4, 4, 12), RecyclingConfig(top_k=4))

    def run():
        result = generate(model, prompt, 40, drafter=drafter)
        return result.tokens, [(s.tree_size, s.accepted) for s in result.steps]

    first = run()
    drafter.forget()
    again = run()
    assert torch.equal(again[0], first[0]) and again[1] == first[1]  # step for step
    control = run()  # no forget: the first run's table is there from the first step
    assert torch.equal(control[0], first[0])  # still exact
    assert first[1][0][0] == 1 and control[1][0][0] > 1
    assert control[1] != first[1]


def test_the_table_saves_loads_and_refuses_another_vocabulary_or_foreign_ids(tmp_path):
    drafter = RecyclingDrafter(DynamicTree(3, 2, 8), RecyclingConfig(top_k=2))
    drafter.begin(torch.tensor([1]))
    drafter.table.rows[3] = ((4, 5), (-0.1, -2.0))
    taught(drafter, TokenTree([5], [-1]), [0], [[6, 7]], [[-0.5, -1.5]])  # still open
    path = tmp_path / "table.json"
    drafter.save_memory(path, vocab_size=100)
    assert drafter.table.rows == {3: ((4, 5), (-0.1, -2.0))}  # saving changed nothing
    loaded = RecyclingTable(top_k=2)
    loaded.load(path, vocab_size=100)
    assert loaded.rows == {3: ((4, 5), (-0.1, -2.0)), 5: ((6, 7), (-0.5, -1.5))}
    with pytest.raises(ValueError, match="vocabulary of 100 tokens, this target has 50"):
        RecyclingTable(2).load(path, vocab_size=50)
    data = json.loads(path.read_text())
    data["ids"][0] = [4, 500]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"table\.json: the row of 3 holds \[500\]"):
        RecyclingTable(2).load(path, vocab_size=100)


@pytest.mark.parametrize("ids, logprobs, refused", [
    ([4, 4], [-0.1, -0.2], r"repeats a successor id: \[4, 4\]"),
    ([4, 5], [0.5, -0.2], r"log-probabilities \[0.5, -0.2\]: each must be a number <= 0"),
    ([4, 5], [float("nan"), -0.2], "log-probabilities .*each must be a number <= 0"),
    ([4, 5], [None, -0.2], "log-probabilities .*each must be a number <= 0"),
    ([4, 5], ["-1", -0.2], "log-probabilities .*each must be a number <= 0"),
    ([4, None], [-0.1, -0.2], "holds \\[None\\], not token ids"),
    (4, [-0.1], "is not a list of successor ids"),
    ([4], -0.1, "is not a list of successor ids"),
])
def test_a_table_row_that_is_not_one_is_refused_naming_the_file(tmp_path, ids, logprobs,
                                                                  refused):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"vocab_size": 100, "top_k": 2, "tokens": [3], "ids": [ids],
                                "logprobs": [logprobs]}))
    with pytest.raises(ValueError, match=rf"table\.json: the row of 3 .*{refused}"):
        RecyclingTable(2).load(path, vocab_size=100)


@pytest.mark.parametrize("name, build", [("recycling", from_config),
                                         ("suffix", suffix_from_config)])
def test_a_warm_file_that_is_missing_or_a_folder_or_a_target_without_tokenizer_is_refused(
        tmp_path, tiny, name, build):
    tree, target = DynamicTree(3, 2, 8), tiny("llama")
    words = dataclasses.replace(target, tokenizer=lambda text, add_special_tokens: {
        "input_ids": [int(word) for word in text.split()]})
    for path, refused in [(tmp_path / "missing.jsonl", "missing.jsonl does not exist"),
                          (tmp_path, f"{tmp_path} is a folder")]:
        with pytest.raises(ValueError, match=refused):
            build({"name": name, "warm_from": str(path)}, tree, words)
    path = tmp_path / "warm.jsonl"
    path.write_text(json.dumps({"text": "40 41 42"}) + "\n")
    with pytest.raises(ValueError, match=rf"warm_from={path}: target tiny-llama has no tokenizer"):
        build({"name": name, "warm_from": str(path)}, tree, target)


def test_forget_goes_back_to_the_warm_start_read_by_the_target(tmp_path, tiny):
    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(word) for word in text.split()]}

    target = dataclasses.replace(tiny("llama"), tokenizer=Tokenizer())
    path = tmp_path / "warm.jsonl"
    path.write_text(json.dumps({"text": "40 41 42 43"}) + "\n")
    drafter = from_config({"name": "recycling", "top_k": 2, "warm_from": str(path)},
                          DynamicTree(3, 2, 8), target)
    with torch.no_grad():
        logits = target.model(torch.tensor([[40, 41, 42, 43]])).logits[0]
    assert set(drafter.table.rows) == {40, 41, 42, 43}
    assert list(drafter.table.rows[41][0]) == logits[1].topk(2).indices.tolist()
    warm = dict(drafter.table.rows)
    generate(target.model, torch.tensor([50, 51, 52]), 12, drafter=drafter)
    drafter.begin(torch.tensor([1]))
    assert len(drafter.table.rows) > len(warm)
    drafter.forget()
    assert drafter.table.rows == warm
