"""TokenTree and TreeTopology against hand-worked examples."""

import pytest
import torch

from verify.tree import DISTRIBUTION_TOLERANCE, TokenTree, TreeBuilder, TreeError, TreeTopology

# root r=9; children a=5 (node 1), b=7 (node 2); a's child c=3 (node 3); c's child d=4 (node 4)
HAND = TokenTree(torch.tensor([9, 5, 7, 3, 4]), torch.tensor([-1, 0, 0, 1, 3]))


def test_depths_and_positions():
    assert HAND.depths.tolist() == [0, 1, 1, 2, 3]
    assert HAND.position_ids(10).tolist() == [10, 11, 11, 12, 13]
    assert HAND.depth == 3


def test_ancestor_mask_by_hand():
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(HAND.ancestor_mask(), expected)


def test_leaf_paths_by_hand():
    assert HAND.leaf_paths() == [[0, 2], [0, 1, 3, 4]]
    assert HAND.children(0) == [1, 2]


def test_from_paths_merges_shared_prefixes():
    tree = TokenTree.from_paths(9, [[5, 3, 4], [7], [5, 6]])
    assert tree.tokens.tolist() == [9, 5, 3, 4, 7, 6]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 1]


def test_topology_from_medusa_choices():
    topo = TreeTopology.from_choices([[1], [0, 0], [0], [0, 1]])
    # sorted by depth, then rank: (0,), (1,), (0,0), (0,1)
    assert topo.choices == ((0,), (1,), (0, 0), (0, 1))
    assert topo.parents == (-1, 0, 0, 1, 1)
    assert topo.ranks == (0, 0, 1, 0, 1)
    assert topo.children(1) == [3, 4]
    assert topo.depth == 2
    tree = TokenTree.from_choices(9, topo, [5, 7, 3, 8])
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1]


def test_chain_topology():
    topo = TreeTopology.chain(3)
    assert topo.parents == (-1, 0, 1, 2) and topo.depth == 3


def test_builder_records_draft_probs_and_zero_rows():
    b = TreeBuilder(1)
    a = b.add(0, 2)
    b.set_draft_probs(0, torch.tensor([0.5, 0.0, 0.5]))
    b.add(a, 0)
    tree = b.build()
    assert tree.draft_probs.shape == (3, 3)
    assert tree.draft_probs[1].sum() == 0  # a's children were deterministic


def test_a_scored_builder_keeps_paths_depths_and_scores_of_a_kept_subtree():
    b = TreeBuilder(7, scored=True)
    a = b.add(0, 1, -0.1)
    b.add(0, 2, -2.0)
    c = b.add(a, 3, -0.5)
    assert b.path(c) == [0, a, c] and [b.depth(n) for n in range(len(b))] == [0, 1, 1, 2]
    whole = b.build()
    assert whole.scores.tolist() == pytest.approx([1.0, 0.905, 0.135, 0.607], abs=1e-3)
    kept = b.build([0, a, c])
    assert kept.tokens.tolist() == [7, 1, 3] and kept.parents.tolist() == [-1, 0, 1]
    assert kept.scores.tolist() == pytest.approx([1.0, 0.905, 0.607], abs=1e-3)
    with pytest.raises(TreeError, match="needs a score"):
        b.add(0, 4)


def test_an_unscored_builder_builds_no_scores_and_refuses_one():
    b = TreeBuilder(1)
    b.add(b.child(0, 5), 6)
    assert b.child(0, 5) == 1 and b.path(2) == [0, 1, 2]
    assert b.build().scores is None and b.build([0, 1]).scores is None
    with pytest.raises(TreeError, match="takes none"):
        b.add(0, 4, -1.0)
    with pytest.raises(TreeError, match="does not exist"):
        b.add(9, 4)


@pytest.mark.parametrize("parents, message", [
    ([-1, 0, 5], "dangling parent 5"),
    ([-1, 2, 0], "dangling parent 2"),
    ([0, 0, 0], "root"),
])
def test_malformed_trees_are_refused(parents, message):
    with pytest.raises(TreeError, match=message):
        TokenTree(torch.tensor([1, 2, 3]), torch.tensor(parents))


def test_duplicate_siblings_are_refused():
    with pytest.raises(TreeError, match="repeats token 4"):
        TokenTree(torch.tensor([1, 4, 4]), torch.tensor([-1, 0, 0]))


def test_choices_without_parent_are_refused():
    with pytest.raises(TreeError, match="has no parent"):
        TreeTopology.from_choices([[0], [1, 0]])


def sampled_tree():
    """Root 9 with children 1 then 2 drawn from q (in that order); node 1 has a deterministic
    child 3, node 2 a deterministic child 4."""
    q = torch.tensor([0.0, 0.5, 0.3, 0.2, 0.0])
    zeros = torch.zeros(5)
    return TokenTree(torch.tensor([9, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 1, 2]),
                     torch.stack([q, zeros, zeros, zeros, zeros]))


def test_sampled_flags_default_to_the_non_zero_draft_rows():
    assert sampled_tree().sampled.tolist() == [True, False, False, False, False]
    assert TokenTree(torch.tensor([1, 2]), torch.tensor([-1, 0])).sampled.tolist() == [False] * 2
    flagged = TokenTree(torch.tensor([1, 2]), torch.tensor([-1, 0]),
                        torch.tensor([[0.5, 0, 0.5], [0.2, 0.8, 0]]), sampled=[False, False])
    assert flagged.sampled.tolist() == [False, False]  # rows given, children deterministic


def test_inconsistent_sampled_flags_are_refused():
    tokens, parents = torch.tensor([1, 2]), torch.tensor([-1, 0])
    with pytest.raises(TreeError, match="no draft_probs"):
        TokenTree(tokens, parents, sampled=[True, False])
    with pytest.raises(TreeError, match="rows are all zero"):
        TokenTree(tokens, parents, torch.tensor([[0.5, 0, 0.5], [0, 0, 0]]),
                  sampled=[True, True])
    with pytest.raises(TreeError, match="sampled has shape"):
        TokenTree(tokens, parents, torch.tensor([[0.5, 0, 0.5], [0, 0, 0]]), sampled=[True])
    # a sampled child must be a draw: its token needs mass in its parent's q
    with pytest.raises(TreeError, match="node 1 drafts token 2.*probability 0"):
        TokenTree(tokens, parents, torch.tensor([[0.5, 0.5, 0.0], [0, 0, 0]]))
    with pytest.raises(TreeError, match="node 1 drafts token 2.*probability 0"):
        TokenTree(tokens, parents, torch.tensor([[0.5, 0.5], [0, 0]]))  # outside q's vocabulary


def test_a_reorder_keeps_sampled_siblings_in_draw_order_or_is_refused():
    tree = sampled_tree()
    depth_first = tree.reorder([0, 1, 3, 2, 4])  # siblings 1, 2 keep their order
    assert depth_first.tokens.tolist() == [9, 1, 3, 2, 4]
    assert depth_first.parents.tolist() == [-1, 0, 1, 0, 3]
    assert depth_first.sampled.tolist() == [True, False, False, False, False]
    assert torch.equal(depth_first.draft_probs[0], tree.draft_probs[0])
    assert [int(depth_first.tokens[c]) for c in depth_first.children(0)] == [1, 2]
    with pytest.raises(TreeError, match="node 0's children were sampled in the order"):
        tree.reorder([0, 2, 1, 4, 3])  # would try 2 before 1: not how they were drawn
    # deterministic siblings may move: the same tree without draft rows reorders freely
    plain = TokenTree(tree.tokens, tree.parents)
    assert plain.reorder([0, 2, 1, 4, 3]).tokens.tolist() == [9, 2, 1, 4, 3]
    with pytest.raises(TreeError, match="every node"):
        tree.reorder([0, 1, 2])


def test_cuts_drop_the_sampled_flags():
    kept = sampled_tree().keep([0, 1, 2])
    assert kept.draft_probs is None and not kept.sampled.any()


def test_a_builder_holds_sampled_children_to_their_draw_order():
    b = TreeBuilder(9)
    b.set_draft_probs(0, torch.tensor([0.0, 0.5, 0.3, 0.2]), draws=[2, 1])
    with pytest.raises(TreeError, match="child 0 must be the next draw .*token 2.*got token 1"):
        b.add(0, 1)  # sorted by q instead of drawn order
    first = b.add(0, 2)
    b.add(0, 1)
    with pytest.raises(TreeError, match="child 2 must be the next draw \\(none\\)"):
        b.add(0, 3)  # not drawn at all
    b.add(first, 3)  # first's children are not sampled: anything goes
    with pytest.raises(TreeError, match="children already"):
        b.set_draft_probs(first, torch.tensor([0.0, 0.0, 0.0, 1.0]), draws=[3])
    tree = b.build()
    assert tree.sampled.tolist() == [True, False, False, False]
    assert tree.tokens.tolist() == [9, 2, 1, 3]
    assert b.build([0, 1]).sampled.tolist() == [False, False]


@pytest.mark.parametrize("row, message", [
    ([0.0, 5.0, 3.0, 2.0, 0.0], "sums to 10"),  # q scaled x10: the ratio test would favour it
    ([0.0, 0.9, 0.3, -0.2, 0.0], "negative entries"),
    ([0.0, 0.5, 0.3, 0.1, 0.0], "sums to 0.9"),
    ([0.0, float("nan"), 0.3, 0.2, 0.0], "sums to nan"),
])
def test_a_sampled_node_whose_draft_row_is_not_a_distribution_is_refused(row, message):
    zeros = torch.zeros(5)
    tokens, parents = torch.tensor([9, 1, 2]), torch.tensor([-1, 0, 0])
    with pytest.raises(TreeError, match=f"node 0 is sampled .*{message}"):
        TokenTree(tokens, parents, torch.stack([torch.tensor(row), zeros, zeros]))
    builder = TreeBuilder(9)
    builder.set_draft_probs(0, torch.tensor(row))
    builder.add(0, 1)
    with pytest.raises(TreeError, match=message):
        builder.build()
    # a deterministic node's row is not read: it may hold anything
    TokenTree(tokens, parents, torch.stack([torch.tensor(row), zeros, zeros]),
              sampled=[False, False, False])


def test_a_row_off_by_less_than_the_tolerance_is_a_distribution():
    q = torch.tensor([0.0, 0.5, 0.3, 0.2 + 0.5 * DISTRIBUTION_TOLERANCE, 0.0])
    tree = TokenTree(torch.tensor([9, 1]), torch.tensor([-1, 0]), torch.stack([q, torch.zeros(5)]))
    assert tree.sampled.tolist() == [True, False]


def test_set_draft_probs_refuses_a_missing_node_or_another_vocabulary():
    builder = TreeBuilder(9)
    builder.add(0, 1)
    for node in (-1, 2):
        with pytest.raises(TreeError, match=f"node {node} does not exist"):
            builder.set_draft_probs(node, torch.tensor([0.5, 0.5]))
    builder.set_draft_probs(0, torch.tensor([0.5, 0.5, 0.0]))
    with pytest.raises(TreeError, match=r"node 1's row has shape \(4,\).*\(3,\)"):
        builder.set_draft_probs(1, torch.tensor([0.25] * 4))
    with pytest.raises(TreeError, match=r"shape \(1, 3\)"):
        builder.set_draft_probs(1, torch.tensor([[0.5, 0.5, 0.0]]))
