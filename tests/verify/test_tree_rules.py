"""Sequence-level tree rules, by exact enumeration on tiny vocabularies: Traversal Verification
and SpecTr's k-sequential selection emit the target's joint over several tree shapes,
temperatures and top-k / top-p; their wrong variants are caught by the same check; traversal
never accepts fewer tokens than recursive rejection sampling on the trees a drafter draws; each
rule refuses, by name, a tree it does not apply to; and the samplers draw what `outcomes`
says."""

from collections import Counter

import pytest
import torch

from experiments.correctness import WrongKSequentialRule, WrongTraversalRule
from experiments.stats import chi_square_test
from tests.verify.tree_enumeration import (
    draft_trees,
    expected_accepted,
    recursive_rejection,
    tables,
    target_rows,
    worst_error,
)
from verify.accept import BlockVerificationRule, RuleRefusal
from verify.multidraft import KSequentialRule, optimal_acceptance
from verify.rules import make_rule
from verify.sampling import SamplingParams
from verify.traversal import TraversalVerificationRule
from verify.tree import TokenTree, TreeTopology

SHAPES = {
    "chain3": TreeTopology.chain(3),
    "fork": TreeTopology.from_choices([(0,), (1,)]),
    "forked-chains": TreeTopology.from_choices([(0,), (1,), (0, 0), (1, 0)]),
    "wide": TreeTopology.from_choices([(0,), (1,), (2,), (0, 0), (0, 1)]),
}
PARAMS = {"t1": SamplingParams(1.0), "t0.7-top2": SamplingParams(0.7, top_k=2),
          "t1.3-top0.8": SamplingParams(1.3, top_p=0.8)}
T1 = SamplingParams(1.0)
VOCAB = 3


def case(shape: str, params: str, seed: int):
    topology = SHAPES[shape]
    p, q = tables(seed, VOCAB, topology.depth, PARAMS[params], close=seed % 2 == 1)
    return p, q, topology


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("iid", [False, True], ids=["without-replacement", "iid"])
def test_traversal_emits_the_target_joint_exactly(shape, params, iid):
    for seed in (0, 1):
        p, q, topology = case(shape, params, seed)
        assert worst_error(TraversalVerificationRule().outcomes, p, q, topology, iid) < 1e-5


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_k_sequential_selection_emits_the_target_joint_exactly(shape, params):
    for seed in (0, 1):
        p, q, topology = case(shape, params, seed)
        assert worst_error(KSequentialRule().outcomes, p, q, topology, iid=True) < 1e-5


def test_the_reference_recursive_rejection_is_exact_too():
    # the yardstick the length comparison below uses must itself be the exact rule
    p, q, topology = case("wide", "t1", 0)
    assert worst_error(recursive_rejection, p, q, topology, iid=False) < 1e-5


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("shape", ["forked-chains", "wide"])
def test_the_wrong_variants_fail_the_same_check(shape, params):
    for seed in (0, 1):
        p, q, topology = case(shape, params, seed)
        assert worst_error(WrongTraversalRule().outcomes, p, q, topology, iid=False) > 1e-3
    # rho = 1 errs by how much two drafts double up: visible once the draft is close
    p, q, topology = case(shape, params, 1)
    assert worst_error(WrongKSequentialRule().outcomes, p, q, topology, iid=True) > 1e-3


def mean_accepted(rule, topology, p, q, iid) -> float:
    """Expected accepted draft tokens over every tree the drafter draws, exactly."""
    return sum(weight * expected_accepted(rule, tree, target_rows(p, tree))
               for tree, weight in draft_trees(topology, q, iid))


@pytest.mark.parametrize("shape", SHAPES)
def test_traversal_never_accepts_fewer_tokens_than_recursive_rejection(shape):
    gains = []
    for seed in range(8):
        for params in PARAMS:
            p, q, topology = case(shape, params, seed)
            traversal = mean_accepted(TraversalVerificationRule().outcomes, topology, p, q, False)
            token = mean_accepted(recursive_rejection, topology, p, q, False)
            assert traversal >= token - 1e-6, (seed, params, traversal, token)
            gains.append(traversal - token)
    if shape == "fork":
        # one level of siblings: leaf-first and root-first try the same draws the same way
        assert max(gains) < 1e-6
    else:
        assert max(gains) > 1e-3


def test_the_guarantee_is_over_the_drafts_not_each_tree():
    # as for block verification: a single unlucky draft can do worse than token-level
    p, q, topology = case("chain3", "t1", 0)
    worst = min(expected_accepted(TraversalVerificationRule().outcomes, tree, rows)
                - expected_accepted(recursive_rejection, tree, rows)
                for tree, _ in draft_trees(topology, q, False)
                for rows in [target_rows(p, tree)])
    assert worst < 0


@pytest.mark.parametrize("seed", range(4))
def test_on_a_chain_traversal_is_block_verification(seed):
    p, q, topology = case("chain3", "t1", seed)
    for tree, _ in draft_trees(topology, q, False):
        rows = target_rows(p, tree)
        accept, bonus = BlockVerificationRule().outcomes(tree, rows)
        for path, chance, residual in TraversalVerificationRule().outcomes(tree, rows):
            k = len(path) - 1
            assert chance == pytest.approx(float(accept[k]), abs=1e-6)
            if chance > 1e-9:
                assert torch.allclose(residual.double(), bonus[k], atol=1e-5)


def test_k_sequential_selection_beats_rejection_on_iid_drafts_and_stays_below_optimal():
    for seed in range(6):
        p, q, topology = case("wide", "t1", seed)
        spectr = mean_accepted(KSequentialRule().outcomes, topology, p, q, True)
        token = mean_accepted(recursive_rejection, topology, p, q, True)
        assert spectr >= token - 1e-6
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        p, q = (torch.randn(6, generator=generator, dtype=torch.float64).mul(2).softmax(-1)
                for _ in range(2))
        for draws in (1, 2, 4):
            ksq, best = KSequentialRule().acceptance(p, q, draws), optimal_acceptance(p, q, draws)
            assert ksq <= best + 1e-6
            assert best <= brute_force_optimum(p, q, draws) + 1e-9
            assert best >= brute_force_optimum(p, q, draws) - 1e-9
        # one draft: every plan is speculative sampling, 1 - TV(p, q)
        assert optimal_acceptance(p, q, 1) == pytest.approx(float(torch.minimum(p, q).sum()))


def brute_force_optimum(p, q, draws) -> float:
    """Hu et al.'s min over every token set H of p(H) + 1 - q(H)^draws."""
    best = 1.0
    for bits in range(1, 2 ** len(p)):
        mask = torch.tensor([bits >> i & 1 for i in range(len(p))], dtype=torch.bool)
        best = min(best, float(p[mask].sum() + 1 - q[mask].sum() ** draws))
    return best


@pytest.mark.parametrize("name, iid, seed", [("traversal", False, 1), ("spectr", True, 2)])
def test_the_rule_draws_the_outcomes_it_computes(name, iid, seed):
    p, q, topology = case("forked-chains", "t1", seed)
    tree = max((drawn for drawn in draft_trees(topology, q, iid)  # the likeliest full tree
                if len(drawn[0]) == topology.size), key=lambda drawn: drawn[1])[0]
    rows = target_rows(p, tree)
    rule = make_rule(name, T1)
    expected = Counter()
    for path, chance, bonus in rule.outcomes(tree, rows):
        for y in range(VOCAB):
            expected[(tuple(path), y)] += chance * float(bonus[y])
    generator, counts = torch.Generator().manual_seed(0), Counter()
    for _ in range(3000):
        accepted = rule(tree, rows.log().float(), T1, generator)
        counts[(tuple(accepted.path), accepted.bonus)] += 1
    assert chi_square_test(counts, dict(expected))[1] > 1e-3
    assert len({path for path, _ in counts}) >= 3


def sampled_fork(iid: bool) -> TokenTree:
    q = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    draws = [[0, 1], None, None] if iid else None
    return TokenTree(torch.tensor([2, 0, 1]), torch.tensor([-1, 0, 0]), q,
                     sampled=torch.tensor([True, False, False]), iid_draws=draws)


CHOSEN = TokenTree(torch.tensor([2, 0, 1]), torch.tensor([-1, 0, 0]))


@pytest.mark.parametrize("name", ["traversal", "spectr"])
def test_a_tree_without_draft_probabilities_is_refused_by_name(name):
    with pytest.raises(RuleRefusal, match=f"'{name}' rule verifies sampled trees.*no draft "
                                          "probabilities"):
        make_rule(name, T1)(CHOSEN, torch.zeros(3, 3), T1)


def test_spectr_refuses_siblings_drawn_without_replacement_naming_the_node():
    with pytest.raises(RuleRefusal, match="'spectr' rule selects among siblings drawn i.i.d.*"
                                          "node 0's children were drawn without replacement"):
        make_rule("spectr", T1)(sampled_fork(iid=False), torch.zeros(3, 3), T1)
    accepted = make_rule("spectr", T1)(sampled_fork(iid=True), torch.zeros(3, 3), T1)
    assert accepted.path[0] == 0


@pytest.mark.parametrize("name", ["traversal", "spectr"])
def test_greedy_decoding_refuses_a_sampling_only_rule(name):
    with pytest.raises(RuleRefusal, match=f"'{name}' rule verifies sampled drafts.*greedy"):
        make_rule(name, SamplingParams())


def test_iid_draws_must_be_the_children_in_first_draw_order():
    q = torch.tensor([[0.5, 0.3, 0.2], [0.0] * 3, [0.0] * 3])
    with pytest.raises(ValueError, match="not its distinct i.i.d. draws"):
        TokenTree(torch.tensor([2, 0, 1]), torch.tensor([-1, 0, 0]), q,
                  sampled=torch.tensor([True, False, False]), iid_draws=[[1, 0, 1], None, None])


def test_iid_draws_move_with_their_nodes_and_a_cut_drops_them():
    # root: i.i.d. draws 0, 0, 1 (children: nodes 1, 2); node 2 drew 2 (node 3); node 1
    # chose token 1 (node 4)
    q = torch.tensor([[0.5, 0.3, 0.2], [0.0] * 3, [0.2, 0.2, 0.6], [0.0] * 3, [0.0] * 3])
    tree = TokenTree(torch.tensor([2, 0, 1, 2, 1]), torch.tensor([-1, 0, 0, 2, 1]), q,
                     sampled=torch.tensor([True, False, True, False, False]),
                     iid_draws=[[0, 0, 1], None, [2], None, None])
    moved = tree.reorder([0, 1, 2, 4, 3])
    assert moved.iid_draws == [[0, 0, 1], None, [2], None, None]
    assert moved.tokens.tolist() == [2, 0, 1, 1, 2] and moved.parents.tolist() == [-1, 0, 0, 1, 2]
    assert tree.keep([0, 1, 2]).iid_draws is None


LONE_ROOTS = {"no-draft": TokenTree(torch.tensor([2]), torch.tensor([-1])),
              "draft-row": TokenTree(torch.tensor([2]), torch.tensor([-1]),
                                     torch.zeros(1, VOCAB))}


@pytest.mark.parametrize("lone", LONE_ROOTS)
@pytest.mark.parametrize("name", ["traversal", "spectr"])
def test_a_lone_root_emits_its_bonus_token_from_the_target(name, lone):
    # plain sampling, a batch past max_batch_for_speculation, a draft model at the end of its
    # positions: the tree is its root alone, and the bonus token is drawn from p
    tree, p = LONE_ROOTS[lone], torch.tensor([[0.2, 0.5, 0.3]])
    rule = make_rule(name, T1)
    assert [(path, chance) for path, chance, _ in rule.outcomes(tree, p)] == [([0], 1.0)]
    assert torch.equal(rule.outcomes(tree, p)[0][2], p[0])
    generator = torch.Generator().manual_seed(0)
    bonus = Counter((rule(tree, p.log(), T1, generator).bonus,) for _ in range(3000))
    assert chi_square_test(bonus, {(t,): float(p[0, t]) for t in range(VOCAB)})[1] > 0.001
