"""Trees from a block's per-position marginals (drafters.block): DDTree's best-first search
against brute force, the filled topologies' draft rows, refusals, and exactness by
enumeration: sampled children drawn from their depth's marginal are exact, and so are DDTree's
chosen children as one-hot proposals; the same DDTree claiming its marginal rows as draws is
not (the control the check must catch)."""

import itertools
import math

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.block import check_block_tree, fill_from_marginals, tree_from_block
from drafters.trees.cost import StepCost
from drafters.trees.ddtree import DDTree, best_first
from drafters.trees.dynamic import DynamicTree
from tests.verify.tree_enumeration import (
    continuations,
    draft_trees,
    recursive_rejection,
    tables,
    tree_emitted,
)
from verify.sampling import SamplingParams, warp
from verify.tree import TokenTree, TreeError, TreeTopology

T1 = SamplingParams(1.0)
GREEDY = SamplingParams()


def marginal_logits(seed: int, depth: int, vocab: int) -> torch.Tensor:
    return 2 * torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed))


def paths(tree: TokenTree) -> set[tuple[int, ...]]:
    mask = tree.ancestor_mask()
    return {tuple(tree.tokens[mask[n]][1:].tolist()) for n in range(1, len(tree))}


@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_best_first_keeps_the_paths_with_the_highest_product_of_marginals(budget):
    log_probs = marginal_logits(0, 3, 4).log_softmax(-1)
    builder = best_first(7, log_probs, budget)
    tree = builder.build()
    every = {path: sum(float(log_probs[d, t]) for d, t in enumerate(path))
             for length in (1, 2, 3) for path in itertools.product(range(4), repeat=length)}
    best = sorted(every.values(), reverse=True)[:budget]
    kept = sorted((every[path] for path in paths(tree)), reverse=True)
    assert len(tree) == budget + 1 and int(tree.tokens[0]) == 7
    assert kept == pytest.approx(best)
    # scores are the paths' probabilities, and a child never outscores its parent
    assert tree.scores[1:].log().sort(descending=True).values.tolist() == pytest.approx(best)
    assert all(tree.scores[n] <= tree.scores[tree.parents[n]] for n in range(1, len(tree)))


def test_best_first_never_proposes_a_token_the_draft_cannot():
    log_probs = torch.full((2, 5), float("-inf"))
    log_probs[0, 3], log_probs[1, 1] = 0.0, -0.1
    tree = best_first(0, log_probs, 10).build()
    assert paths(tree) == {(3,), (3, 1)}


def test_ddtree_depth_limit_and_cost_cut():
    log_probs = marginal_logits(1, 4, 6).log_softmax(-1)
    shallow = DDTree(total_tokens=12, depth=2).grow(0, log_probs)
    assert int(shallow.depths.max()) <= 2 and len(shallow) == 13
    # a verification cost that rises steeply past 2 tokens keeps at most one draft node
    steep = StepCost({1: 10.0, 2: 10.1, 4: 40.0, 16: 200.0})
    cut = DDTree(total_tokens=12, cost=steep).grow(0, log_probs)
    assert len(cut) <= 2


def test_a_filled_topology_draws_each_depths_children_from_its_marginal():
    topology = TreeTopology.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    marginals = marginal_logits(2, 3, 9)
    tree = fill_from_marginals(topology, 5, marginals, T1, torch.Generator().manual_seed(0))
    assert len(tree) == topology.size
    for node in range(len(tree)):
        if tree.children(node):  # every parent at depth d holds depth d's warped marginal
            assert bool(tree.sampled[node])
            expected = warp(marginals[int(tree.depths[node])], T1)
            assert torch.allclose(tree.draft_probs[node], expected)
    greedy = fill_from_marginals(TreeTopology.chain(3), 5, marginals, GREEDY, None)
    assert greedy.tokens[1:].tolist() == marginals.argmax(-1).tolist()
    assert greedy.draft_probs is None


def test_trees_deeper_than_the_block_are_refused():
    check_block_tree(TreeTopology.chain(7), 7, "dflash", "drafter.block_size - 1")
    for tree in (TreeTopology.chain(8), DynamicTree(8, 2, 8), DDTree(8, depth=9)):
        with pytest.raises(TreeError, match=r"exceeds what dflash can fill: its block drafts 7 "
                           r"positions \(drafter.block_size - 1\)"):
            check_block_tree(tree, 7, "dflash", "drafter.block_size - 1")
    with pytest.raises(ValueError, match=r"marginals must be \(D, V\)"):
        tree_from_block(DDTree(4), 0, torch.zeros(5), GREEDY)


def test_a_ddtree_is_refused_by_drafters_without_a_block(tiny, conf):
    with pytest.raises(TreeError, match="'ddtree8' is a DDTree.*drafter 'eagle' has none"):
        build_drafter(conf("drafter", "eagle"), conf("tree", "ddtree8"), tiny("llama"))


# --- exactness by enumeration (vocabulary 3, depth 2: every tree and outcome) ---------------

VOCAB, DEPTH = 3, 2


def block_tables(seed: int):
    """The target's conditionals p per prefix, and a block drafter's q: one marginal per
    depth, the same whatever the prefix (what DFlash and PARD give)."""
    p, _ = tables(seed, VOCAB, DEPTH, T1, close=False)
    marginals = warp(marginal_logits(seed + 100, DEPTH + 1, VOCAB), T1).double()
    q = {prefix: marginals[len(prefix)] for prefix in p}
    return p, q, marginals


def joint(p):
    return dict(continuations(p, (), DEPTH + 1))


def error(out, p) -> float:
    target = joint(p)
    return max(abs(out.get(seq, 0.0) - target.get(seq, 0.0)) for seq in set(out) | set(target))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_children_drawn_from_their_depths_marginal_are_exact(seed):
    p, q, _ = block_tables(seed)
    topology = TreeTopology.from_choices([[0], [1], [0, 0], [0, 1], [1, 0]])
    out = {}
    for tree, weight in draft_trees(topology, q, iid=False):
        for seq, mass in tree_emitted(recursive_rejection, p, tree, DEPTH + 1, weight).items():
            out[seq] = out.get(seq, 0.0) + mass
    assert error(out, p) < 1e-5  # float32 rows: within rounding


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ddtree_children_are_exact_as_one_hot_proposals_and_biased_as_draws(seed):
    p, _, marginals = block_tables(seed)
    tree = DDTree(total_tokens=4, depth=DEPTH).grow(0, marginals.log())
    assert tree.draft_probs is None and not bool(tree.sampled.any())
    assert error(tree_emitted(recursive_rejection, p, tree, DEPTH + 1), p) < 1e-5
    # the control: the same chosen children passed off as draws from their marginals
    rows = torch.stack([marginals[min(int(d), DEPTH)] for d in tree.depths]).float()
    has_children = torch.tensor([bool(tree.children(n)) for n in range(len(tree))])
    rows[~has_children] = 0
    wrong = TokenTree(tree.tokens, tree.parents, rows, sampled=has_children)
    assert error(tree_emitted(recursive_rejection, p, wrong, DEPTH + 1), p) > 0.01


def test_a_fresh_dflash_ddtree_decodes_a_sampled_batch(tiny, conf):
    from verify.loop import generate_batch

    target = tiny("llama")
    drafter = build_drafter(conf("drafter", "dflash"),
                            OmegaConf.merge(conf("tree", "ddtree8"), {"total_tokens": 5}), target)
    prompts = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])]
    results = generate_batch(target.model, prompts, 12, drafter=drafter, sampling=T1,
                             generator=torch.Generator().manual_seed(0))
    assert all(len(r.tokens) == 12 for r in results)
    assert max(step.tree_size for r in results for step in r.steps) == 6
    assert math.isfinite(sum(r.tau for r in results))
