"""TokenTree and TreeTopology against hand-worked examples."""

import pytest
import torch

from verify.tree import TokenTree, TreeBuilder, TreeError, TreeTopology

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
