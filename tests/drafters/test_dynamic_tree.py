"""EAGLE-2's dynamic tree policy on hand-set draft log-probabilities (no model)."""

import math

import pytest
import torch

from drafters.trees import tree_policy
from drafters.trees.dynamic import DynamicTree
from verify.tree import TreeBuilder

V = 10
ROOT = 99


def row(probs: dict[int, float]) -> torch.Tensor:
    """(V,) log-probabilities: the given tokens' probabilities, -inf elsewhere."""
    out = torch.full((V,), float("-inf"))
    for token, p in probs.items():
        out[token] = math.log(p)
    return out


class FakeExpand:
    """expand() from a table {token path below the root: (V,) log-probs}; records its calls.
    Paths missing from the table get `default(path)`, or fail the test."""

    def __init__(self, table=None, default=None):
        self.table, self.default, self.calls = table or {}, default, []

    def __call__(self, candidates: TreeBuilder, nodes: list[int]) -> torch.Tensor:
        self.calls.append(list(nodes))
        paths = [tuple(candidates.tokens[n] for n in candidates.path(node)[1:]) for node in nodes]
        return torch.stack([self.table[p] if p in self.table else self.default(p)
                            for p in paths])


def random_rows(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed random (V,) draft distribution per path, a few tokens outside the vocabulary."""
    generator = torch.Generator().manual_seed(hash(path) % 2**31)
    logits = torch.randn(V, generator=generator) * 2
    logits[torch.randperm(V, generator=generator)[:2]] = float("-inf")
    return logits.log_softmax(-1)


# Worked example (top_k 2): scores are products of probabilities along the path.
#   root -> 1 (.6), 2 (.3)                          round 1; token 3 (.1) is not in the top 2
#   1 -> 4 (.54), 5 (.06);  2 -> 6 (.15), 7 (.15)   round 2 expands candidates 1, 2
#   4 -> 8 (.27), 9 (.27);  6 -> 8 (.15)            round 3 expands 1-4 (.54) and 2-6 (.15,
#                                                   tied with 2-7: the earlier candidate wins)
TABLE = {(): row({1: .6, 2: .3, 3: .1}),
         (1,): row({4: .9, 5: .1}), (2,): row({6: .5, 7: .5}),
         (1, 4): row({8: .5, 9: .5}), (2, 6): row({8: 1.0})}


def test_worked_example_expands_the_best_frontier_and_keeps_the_best_nodes_parents_first():
    expand = FakeExpand(TABLE)
    tree = DynamicTree(depth=3, top_k=2, total_tokens=4).grow(ROOT, TABLE[()], expand)
    assert expand.calls == [[1, 2], [3, 5]]  # candidates 1-4 and 2-6
    # kept: 1 (.6), 1-4 (.54), 2 (.3), 1-4-8 (.27; ties 1-4-9, the earlier candidate)
    assert tree.tokens.tolist() == [ROOT, 1, 2, 4, 8]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert tree.draft_probs is None


def test_candidates_hold_every_proposal_with_cumulative_scores():
    candidates = DynamicTree(3, 2, 4).search(ROOT, TABLE[()], FakeExpand(TABLE))
    assert len(candidates) == 1 + 2 + 4 + 3
    assert candidates.tokens == [ROOT, 1, 2, 4, 5, 6, 7, 8, 9, 8]
    assert candidates.parents == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 5]
    assert candidates.log_scores[7] == pytest.approx(math.log(.27), abs=1e-6)
    assert candidates.path(9) == [0, 2, 5, 9]
    assert [candidates.depth(n) for n in (0, 2, 5, 9)] == [0, 1, 2, 3]


def test_a_large_budget_keeps_every_candidate():
    tree = DynamicTree(3, 2, total_tokens=100).grow(ROOT, TABLE[()], FakeExpand(TABLE))
    assert len(tree) == 10 and tree.depth == 3


def test_depth_one_keeps_the_roots_top_k_capped_by_total_tokens():
    expand = FakeExpand()
    assert DynamicTree(1, 3, 5).grow(ROOT, TABLE[()], expand).tokens.tolist() == [ROOT, 1, 2, 3]
    assert DynamicTree(1, 3, 2).grow(ROOT, TABLE[()], expand).tokens.tolist() == [ROOT, 1, 2]
    assert expand.calls == []


def test_minus_inf_tokens_are_never_proposed_and_an_empty_frontier_stops():
    table = {(): row({3: .5, 6: .5}), (3,): torch.full((V,), float("-inf")),
             (6,): row({0: 1.0})}
    expand = FakeExpand(table, default=lambda path: torch.full((V,), float("-inf")))
    tree = DynamicTree(depth=5, top_k=4, total_tokens=10).grow(ROOT, table[()], expand)
    assert tree.tokens.tolist() == [ROOT, 3, 6, 0]  # two root children, not four
    assert tree.parents.tolist() == [-1, 0, 0, 2]
    assert expand.calls == [[1, 2], [3]]  # round 4 would have no frontier: no call


def test_ties_go_to_lower_tokens_and_shallower_nodes():
    uniform = torch.full((V,), -math.log(V))
    tree = DynamicTree(1, 3, 3).grow(ROOT, uniform, FakeExpand())
    assert tree.tokens.tolist() == [ROOT, 0, 1, 2]
    # a child of probability 1 ties its parent: the parent is kept, the child is not
    sure = {(): row({4: 1.0}), (4,): row({5: 1.0}), (4, 5): row({6: 1.0})}
    tree = DynamicTree(3, 2, total_tokens=2).grow(ROOT, sure[()], FakeExpand(sure))
    assert tree.tokens.tolist() == [ROOT, 4, 5]


def test_a_node_is_never_kept_without_its_parent():
    # Positive "log-probabilities" (a broken expand) rank 2-3 first; its parent 2 is not yet kept.
    table = {(): row({1: .5, 2: .4}), (1,): torch.full((V,), float("-inf")),
             (2,): torch.full((V,), float("-inf")).index_fill(0, torch.tensor([3]), 5.0)}
    tree = DynamicTree(2, 2, total_tokens=2).grow(ROOT, table[()], FakeExpand(table))
    assert tree.tokens.tolist() == [ROOT, 1, 2]


@pytest.mark.parametrize("depth, top_k, total_tokens", [(2, 2, 3), (4, 3, 10), (5, 4, 24)])
def test_random_drafts_obey_every_rule(depth, top_k, total_tokens):
    policy, expand = DynamicTree(depth, top_k, total_tokens), FakeExpand(default=random_rows)
    root_logprobs = random_rows(())
    candidates = policy.search(ROOT, root_logprobs, FakeExpand(default=random_rows))
    tree = policy.grow(ROOT, root_logprobs, expand)  # TokenTree validates itself on creation
    assert 1 <= tree.depth <= depth
    assert len(tree) == 1 + min(total_tokens, len(candidates) - 1)
    assert len(expand.calls) == depth - 1  # 2 of 10 tokens are -inf: a frontier never runs dry
    previous = [0]
    for frontier in expand.calls:
        # a frontier is the best top_k of the children of the previous one, parents first
        level = [n for n in range(len(candidates)) if candidates.parents[n] in previous]
        best = sorted(level, key=lambda n: -candidates.log_scores[n])[:top_k]
        assert frontier == sorted(best)
        previous = frontier
    kept = policy.rerank(candidates)
    dropped = set(range(len(candidates))) - set(kept)
    assert min(candidates.log_scores[n] for n in kept) >= max(
        (candidates.log_scores[n] for n in dropped), default=float("-inf"))
    assert all(candidates.parents[n] in kept for n in kept[1:])


def test_a_root_with_fewer_finite_tokens_than_top_k():
    tree = DynamicTree(1, 8, 24).grow(ROOT, row({7: 1.0}), FakeExpand())
    assert tree.tokens.tolist() == [ROOT, 7]


@pytest.mark.parametrize("field", ["depth", "top_k", "total_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_sizes_must_be_positive_integers(field, value):
    sizes = {"depth": 2, "top_k": 2, "total_tokens": 2, field: value}
    with pytest.raises(ValueError, match=field):
        DynamicTree(**sizes)


def test_expand_and_root_shapes_are_checked():
    with pytest.raises(ValueError, match="root_logprobs"):
        DynamicTree(2, 2, 2).grow(ROOT, TABLE[()][None], FakeExpand(TABLE))
    with pytest.raises(ValueError, match="expected \\(2, V\\)"):
        DynamicTree(2, 2, 2).grow(ROOT, TABLE[()], lambda candidates, nodes: TABLE[()][None])


def test_the_shipped_config_builds(conf):
    assert tree_policy(conf("tree", "eagle2")) == DynamicTree(5, 8, 24)


def test_rounds_stop_at_the_budget_and_keep_the_same_tree():
    # 2 nodes can be kept at most 2 deep: a third round would be drafted for nothing
    calls = []

    def expand(candidates, nodes):
        calls.append(len(nodes))
        return torch.log_softmax(torch.arange(8.0).flip(0)[None].expand(len(nodes), 8), -1)

    root = torch.log_softmax(torch.arange(8.0).flip(0), -1)
    shallow = DynamicTree(depth=5, top_k=2, total_tokens=2).grow(0, root, expand)
    assert len(calls) == 1  # rounds 1 (the root's children) and 2
    calls.clear()
    # every round grown (a budget that never binds), then the best 2 kept as before
    full = DynamicTree(depth=5, top_k=2, total_tokens=100).search(0, root, expand)
    deep = full.build(DynamicTree(depth=5, top_k=2, total_tokens=2).rerank(full))
    assert len(calls) == 4
    assert torch.equal(shallow.tokens, deep.tokens) and torch.equal(shallow.parents, deep.parents)
