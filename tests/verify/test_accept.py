"""Acceptance rules on hand-set logits."""

import pytest
import torch

from verify.accept import (
    GreedyRule,
    SpeculativeSamplingRule,
    TypicalRule,
)
from verify.rules import check_rule, make_rule, rule_from_config
from verify.sampling import SamplingParams, warp
from verify.tree import TokenTree, TreeBatch

V = 5
GREEDY = SamplingParams()
# root 0; children 1 (node 1) and 2 (node 2); node 1's child 3 (node 3)
TREE = TokenTree(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]))


def logits_with_argmax(*best):
    logits = torch.zeros(len(best), V)
    for row, token in enumerate(best):
        logits[row, token] = 5.0
    return logits


def test_greedy_accepts_longest_matching_path_plus_bonus():
    # root predicts 1, node 1 predicts 3, node 3 predicts 4 -> path 0,1,3 and bonus 4
    accepted = GreedyRule()(TREE, logits_with_argmax(1, 3, 0, 4), GREEDY)
    assert accepted.path == [0, 1, 3] and accepted.bonus == 4 and accepted.num_accepted == 2


def test_greedy_takes_second_sibling():
    accepted = GreedyRule()(TREE, logits_with_argmax(2, 0, 1, 0), GREEDY)
    assert accepted.path == [0, 2] and accepted.bonus == 1


def test_greedy_rejects_everything():
    accepted = GreedyRule()(TREE, logits_with_argmax(4, 0, 0, 0), GREEDY)
    assert accepted.path == [0] and accepted.bonus == 4


def test_sampling_at_temperature_zero_equals_greedy():
    logits = logits_with_argmax(1, 3, 0, 4)
    accepted = SpeculativeSamplingRule()(TREE, logits, GREEDY)
    assert accepted.path == [0, 1, 3] and accepted.bonus == 4


def test_sampling_one_hot_draft_acceptance_probability():
    # target p = (0.5, 0.3, 0.2, 0, 0) at the root; deterministic drafts [1, 2]:
    # P(accept node 1) = p(1) = 0.3; P(node 2) = 0.2; else bonus 0 from the residual.
    logits = torch.full((4, V), -1e9)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    logits[1:, 0] = 0.0
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(4000):
        a = SpeculativeSamplingRule()(TREE, logits, params, gen)
        counts[{1: 0, 2: 1}.get(a.path[1], 2) if len(a.path) > 1 else 2] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.3, 0.2, 0.5]), atol=0.03)


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.1, 0.6, 0.3])
    r = SpeculativeSamplingRule().residual(p, q)
    assert torch.allclose(r, torch.tensor([1.0, 0.0, 0.0]))


def test_sampling_uses_draft_probs_ratio():
    # p(1) = 0.3, q(1) = 0.6 -> accept with probability 0.5
    tree = TokenTree(torch.tensor([0, 1]), torch.tensor([-1, 0]),
                     draft_probs=torch.tensor([[0.1, 0.6, 0.3, 0, 0], [0] * 5]))
    logits = torch.full((2, V), -1e9)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    logits[1, 0] = 0.0
    gen = torch.Generator().manual_seed(1)
    runs = [SpeculativeSamplingRule()(tree, logits, SamplingParams(1.0), gen) for _ in range(4000)]
    accepted = sum(a.num_accepted for a in runs) / len(runs)
    assert abs(accepted - 0.5) < 0.03
    # after a rejection the residual is norm(max(p - q, 0)) = token 0 only
    assert all(a.bonus == 0 for a in runs if a.num_accepted == 0)


def test_typical_accepts_confident_tokens_and_is_lossy():
    logits = logits_with_argmax(1, 3, 0, 4)
    a = TypicalRule()(TREE, logits, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert a.path == [0, 1, 3]
    assert not TypicalRule.exact and GreedyRule.exact and SpeculativeSamplingRule.exact


def test_typical_rejects_unlikely_tokens():
    logits = torch.zeros(4, V)  # uniform: p = 0.2 > min(0.09, 0.3 * exp(-log 5)) = 0.06
    logits[0, 1] = -10.0  # node 1's token is now very unlikely at the root
    a = TypicalRule()(TREE, logits, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert a.path == [0, 2]


def test_a_set_epsilon_changes_what_typical_acceptance_accepts():
    uniform = torch.zeros(4, V)  # p = 0.2 everywhere; alpha * exp(-entropy) = 2 * 0.2 = 0.4
    params, seed = SamplingParams(1.0), torch.Generator().manual_seed(0)
    loose = make_rule("typical", params, epsilon=0.1, alpha=2.0)  # threshold min(0.1, 0.4)
    strict = make_rule("typical", params, epsilon=0.25, alpha=2.0)  # min(0.25, 0.4) > 0.2
    assert loose(TREE, uniform, params, seed).path == [0, 1, 3]
    assert strict(TREE, uniform, params, seed).path == [0]
    # the same settings from a config mapping, as bench's rule.name=...,rule.epsilon=... give
    configured = rule_from_config({"name": "typical", "epsilon": 0.25, "alpha": 2.0}, params)
    assert (configured.epsilon, configured.alpha) == (0.25, 2.0)
    assert rule_from_config({"name": "typical", "epsilon": 0.25}, params).alpha == 0.5


def test_unknown_rule_settings_are_refused_naming_the_known_ones():
    params = SamplingParams(1.0)
    with pytest.raises(ValueError, match=r"'typical' has no setting\(s\) \['eps'\]; its "
                                         r"settings: \['alpha', 'epsilon'\]"):
        make_rule("typical", params, eps=0.1)
    with pytest.raises(ValueError, match="'sampling' has no setting.*its settings: none"):
        rule_from_config({"name": "sampling", "epsilon": 0.1}, params)
    with pytest.raises(ValueError, match="need the rule's name"):
        rule_from_config({"epsilon": 0.1}, params)


@pytest.mark.parametrize("settings, key", [({"epsilon": -0.01}, "epsilon"),
                                           ({"epsilon": float("nan")}, "epsilon"),
                                           ({"epsilon": 0.1, "alpha": -1.0}, "alpha"),
                                           ({"epsilon": "0.1"}, "epsilon")])
def test_typical_settings_out_of_range_are_refused_when_the_rule_is_made(settings, key):
    # a negative epsilon's default alpha (its square root) was complex, failing mid-run
    with pytest.raises(ValueError, match=f"rule.{key} must be a number >= 0"):
        make_rule("typical", SamplingParams(1.0), **settings)
    with pytest.raises(ValueError, match=f"rule.{key} must be a number >= 0"):
        check_rule("typical", settings)


def test_warp_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert (warp(logits, SamplingParams(1.0, top_k=2))[2:] == 0).all()
    probs = warp(logits, SamplingParams(1.0, top_p=0.5))
    assert probs[0] == 1.0  # the top token alone already holds >= 50%
    assert torch.equal(warp(logits, GREEDY), torch.tensor([1.0, 0, 0, 0]))


def test_rule_choice_and_bad_parameters():
    assert make_rule(None, GREEDY).name == "greedy"
    assert make_rule(None, SamplingParams(0.7)).name == "sampling"
    with pytest.raises(ValueError, match="unknown acceptance rule"):
        make_rule("nope", GREEDY)
    with pytest.raises(ValueError, match="temperature 0"):
        make_rule("greedy", SamplingParams(1.0))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-0.1)


def test_draft_with_zero_recorded_probability_is_refused():
    tree = TokenTree(torch.tensor([0, 1]), torch.tensor([-1, 0]),
                     draft_probs=torch.tensor([[0.3, 0.4, 0.3, 0, 0], [0] * 5]))
    tree.draft_probs[0, 1] = 0.0  # changed after the tree checked it: the rule refuses too
    with pytest.raises(ValueError, match="probability 0"):
        SpeculativeSamplingRule()(tree, torch.zeros(2, V), SamplingParams(1.0))


def flagged_trees():
    """One tree three ways: no draft rows, rows flagged deterministic, rows flagged sampled
    (the default for non-zero rows)."""
    tokens, parents = torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 1])
    rows = torch.tensor([[0.1, 0.6, 0.3, 0, 0], [0, 0, 0, 0.5, 0.5], [0] * 5, [0] * 5])
    return (TokenTree(tokens, parents), TokenTree(tokens, parents, rows, sampled=[False] * 4),
            TokenTree(tokens, parents, rows))


def test_a_node_flagged_deterministic_is_one_hot_whatever_its_draft_row():
    plain, deterministic, sampled = flagged_trees()
    assert sampled.sampled.tolist() == [True, True, False, False]
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    rule, params, differ = SpeculativeSamplingRule(), SamplingParams(1.0), 0
    for seed in range(200):
        runs = [rule(tree, logits, params, torch.Generator().manual_seed(seed))
                for tree in (plain, deterministic, sampled)]
        assert runs[0] == runs[1]
        differ += runs[0] != runs[2]
    assert differ > 0  # the flag is what changed the outcome
    # the vectorized rule reads the flags too (through the batch)
    trees = [plain, deterministic] * 50
    batch = TreeBatch.pad(trees)
    assert batch.sampled.any(1).tolist() == [False, False] * 50
    out = rule.accept_batch(trees, batch, logits.expand(len(trees), -1, -1), params,
                            torch.Generator().manual_seed(0))
    again = rule.accept_batch([plain] * 100, TreeBatch.pad([plain] * 100),
                              logits.expand(100, -1, -1), params,
                              torch.Generator().manual_seed(0))
    assert out == again
