"""The hybrid drafter: merging trees, picking a member by score, telling members what was
accepted on their own trees, and handing a skipped member every feature it missed."""

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.hybrid import HybridConfig, HybridDrafter, _follow, merge_trees
from tests.verify.test_predictions import Recorder, check_against_plain_forwards
from verify.accept import Acceptance
from verify.loop import generate
from verify.predictions import top_k_predictions
from verify.protocol import DraftContext
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeError

GREEDY = SamplingParams(0.0)


def scored(tokens, parents, scores=None) -> TokenTree:
    return TokenTree(tokens, parents, scores=None if scores is None else torch.tensor(scores))


def test_merge_shares_prefixes_and_scores_a_node_by_its_best_member():
    a = scored([1, 2, 3], [-1, 0, 1], [1.0, 0.9, 0.5])
    b = scored([1, 2, 4, 5], [-1, 0, 1, 0], [1.0, 0.6, 0.4, 0.3])
    merged = merge_trees([a, b], budget=None)
    assert merged.tokens.tolist() == [1, 2, 3, 4, 5]
    assert merged.parents.tolist() == [-1, 0, 1, 1, 0]
    assert merged.scores.tolist() == pytest.approx([1.0, 0.9, 0.5, 0.4, 0.3])
    assert merged.draft_probs is None


def test_merge_cuts_to_the_budget_best_first_parents_kept():
    a = scored([1, 2, 3], [-1, 0, 1], [1.0, 0.9, 0.5])
    b = scored([1, 2, 4, 5], [-1, 0, 1, 0], [1.0, 0.6, 0.4, 0.3])
    assert merge_trees([a, b], budget=2).tokens.tolist() == [1, 2, 3]
    unscored = scored([1, 7], [-1, 0])  # a member without scores ranks last
    assert merge_trees([unscored, a], budget=2).tokens.tolist() == [1, 2, 3]
    with pytest.raises(TreeError, match="share their root"):
        merge_trees([a, scored([9], [-1])], None)


def test_a_member_is_told_the_accepted_tokens_on_its_own_tree():
    own = scored([1, 2, 3], [-1, 0, 1])
    verified = scored([1, 2, 3, 4], [-1, 0, 1, 2])
    # accepted 2 3 4 with bonus 6: own has 2 3 only, so from its view 4 is the next token
    assert _follow(own, verified, Acceptance([0, 1, 2, 3], 6)) == Acceptance([0, 1, 2], 4)
    # the bonus 3 was drafted by own too: its path stops before it
    assert _follow(own, verified, Acceptance([0, 1], 3)) == Acceptance([0, 1], 3)


class Fixed:
    """A member proposing a fixed tree, recording what it saw (and, asking for the target's
    top `top_k`, the predictions it was told)."""

    def __init__(self, tree: TokenTree, layers=(), top_k=0):
        self.tree, self.feature_layers, self.target_top_k = tree, layers, top_k
        self.seen, self.updates, self.predictions = [], [], []

    def begin(self, prompt):
        self.seen.clear()

    def propose(self, ctx):
        self.seen.append(None if ctx.features is None else ctx.features.clone())
        return self.tree

    def update(self, tree, acceptance):
        self.updates.append((tree, acceptance.path))
        self.predictions.append(acceptance.predictions)

    def fork(self):
        return Fixed(self.tree, self.feature_layers, self.target_top_k)


def test_pick_takes_the_first_confident_member_and_skips_the_rest():
    sure = Fixed(scored([1, 2, 3], [-1, 0, 1], [1.0, 0.9, 0.8]))
    model = Fixed(scored([1, 5], [-1, 0], [1.0, 0.5]), layers=(-1,))
    hybrid = HybridDrafter([("suffix", sure), ("eagle", model)], None,
                           HybridConfig(threshold=1.5))
    hybrid.set_hidden_size(2)
    hybrid.begin(torch.tensor([1]))
    ctx = DraftContext(torch.tensor([1]), torch.ones(1, 2), GREEDY)
    assert hybrid.propose(ctx) is sure.tree and model.seen == []
    sure.tree = scored([1, 2], [-1, 0], [1.0, 0.2])  # not confident: the model proposes
    assert hybrid.propose(DraftContext(torch.tensor([1]), 2 * torch.ones(2, 2), GREEDY)) \
        is model.tree
    # the model gets both steps' feature rows, in order: the one it skipped first
    assert model.seen[0].tolist() == [[1, 1], [2, 2], [2, 2]]
    assert dict(hybrid.proposed) == {"suffix": 1, "eagle": 1}
    hybrid.update(model.tree, Acceptance([0, 1], 7))
    assert model.updates == [(model.tree, [0, 1])]
    assert sure.updates[0][1] == [0]  # it ran, and its tree had no 5: nothing accepted


def test_each_member_reads_its_own_layers_in_its_own_order():
    a = Fixed(scored([1, 2], [-1, 0], [1.0, 0.9]), layers=(1, 14, 26))
    b = Fixed(scored([1, 2], [-1, 0], [1.0, 0.9]), layers=(-1, 26))
    hybrid = HybridDrafter([("a", a), ("b", b)], None, HybridConfig(policy="merge"))
    hybrid.set_hidden_size(2)
    assert hybrid.feature_layers == (1, 14, 26, -1)
    hybrid.begin(torch.tensor([1]))
    features = torch.arange(8.0)[None]  # layer 1: 0 1, 14: 2 3, 26: 4 5, -1: 6 7
    hybrid.propose(DraftContext(torch.tensor([1]), features, GREEDY))
    assert a.seen[0].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert b.seen[0].tolist() == [[6, 7, 4, 5]]


def test_each_member_is_told_the_predictions_at_its_own_nodes_where_verified():
    a = Fixed(scored([1, 2, 3], [-1, 0, 1], [1.0, 0.9, 0.5]), top_k=2)
    b = Fixed(scored([1, 2, 4, 5], [-1, 0, 1, 0], [1.0, 0.6, 0.4, 0.3]), top_k=3)
    c = Fixed(scored([1, 2], [-1, 0], [1.0, 0.8]))  # asks for none
    hybrid = HybridDrafter([("a", a), ("b", b), ("c", c)], None,
                           HybridConfig(policy="merge", budget=2))
    assert hybrid.target_top_k == 3  # what the member asking most needs
    hybrid.begin(torch.tensor([1]))
    merged = hybrid.propose(DraftContext(torch.tensor([1]), None, GREEDY))
    assert merged.tokens.tolist() == [1, 2, 3]  # b's 4 and 5 cut by the budget
    told = top_k_predictions(torch.randn(1, 3, 10), [3], 3)[0]
    hybrid.update(merged, Acceptance([0, 1], 9, told))
    [for_a], [for_b] = a.predictions, b.predictions
    assert torch.equal(for_a.ids, told.ids[:, :2]) and bool(for_a.verified.all())
    assert for_b.verified.tolist() == [True, True, False, False]
    assert torch.equal(for_b.ids[:2], told.ids[:2]) and (for_b.ids[2:] == -1).all()
    assert torch.equal(for_b.logprobs[:2], told.logprobs[:2])
    assert (for_b.logprobs[2:] == float("-inf")).all()
    assert c.predictions == [None]


def test_through_the_loop_each_member_is_told_the_plain_forward_top_k(tiny):
    model = tiny("llama").model
    prompt = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41])
    references = {tuple(prompt.tolist()): generate(model, prompt, 12).tokens.tolist()}
    first, second = Recorder(references, 3), Recorder(references, 1, salt=5)
    hybrid = HybridDrafter([("first", first), ("second", second)], None,
                           HybridConfig(policy="merge"))
    generate(model, prompt, 12, drafter=hybrid)
    # every member node is in the merged tree (no budget): each is the plain forward's
    check_against_plain_forwards(model, first.record, 3)
    check_against_plain_forwards(model, second.record, 1)


def test_policies_and_members_are_checked():
    member = Fixed(scored([1], [-1]))
    with pytest.raises(ValueError, match="at least two members"):
        HybridDrafter([("a", member)], None)
    with pytest.raises(ValueError, match="policy must be one of"):
        HybridDrafter([("a", member), ("b", member)], None, HybridConfig(policy="vote"))


def test_a_nan_threshold_and_a_member_without_a_name_are_refused(tiny):
    member = Fixed(scored([1], [-1]))
    with pytest.raises(ValueError, match="drafter.threshold must be a number .*got nan"):
        HybridDrafter([("a", member), ("b", member)], None,
                      HybridConfig(threshold=float("nan")))
    tree = {"depth": 2, "top_k": 2, "total_tokens": 4}
    for nameless in ({"min_token_prob": 0.1}, {"name": None}):
        with pytest.raises(ValueError, match="hybrid member .* has no name"):
            build_drafter({"name": "hybrid", "members": ["suffix", nameless]}, tree,
                          tiny("llama"))


@pytest.mark.parametrize("policy", ["pick", "merge"])
def test_a_hybrid_decodes_like_plain_decoding_and_counts_its_proposers(policy, tiny, conf):
    target = tiny("llama")
    prompt = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 40, 41])
    plain = generate(target.model, prompt, 40).tokens
    cfg = OmegaConf.merge(conf("drafter", "hybrid"), {"policy": policy, "threshold": 0.5})
    hybrid = build_drafter(cfg, conf("tree", "suffix"), target)
    first = generate(target.model, prompt, 40, drafter=hybrid)
    second = generate(target.model, prompt, 40, drafter=hybrid)  # memory: its first answer
    assert torch.equal(first.tokens, plain) and torch.equal(second.tokens, plain)
    assert second.tau > first.tau  # the suffix member copies the earlier answer
    assert sum(hybrid.proposed.values()) == len(first.steps) + len(second.steps)
    if policy == "pick":
        assert hybrid.proposed["suffix"] > 0 and hybrid.proposed["eagle"] > 0


def test_sam_hybrid_drafts_by_suffix_on_long_matches_else_by_recycling(tiny, conf):
    # the shipped preset: suffix when its match is >= min_match tokens, else Token Recycling
    target = tiny("llama")
    tree = OmegaConf.merge(conf("tree", "recycling"),
                           {"cost": {"measure": False, "t_ms": {1: 10.0, 32: 11.0}}})
    drafter = build_drafter(conf("drafter", "sam_hybrid"), tree, target)
    prompt = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 40, 41])
    plain = generate(target.model, prompt, 48).tokens
    first = generate(target.model, prompt, 48, drafter=drafter)
    # a random model's text never repeats 4 tokens: recycling drafted every step
    assert dict(drafter.proposed) == {"recycling": len(first.steps)}
    # the same prompt again, memory kept (no forget: a test of the switch, not a benchmark):
    # the first answer sits in the suffix memory, so long matches send steps to suffix
    second = generate(target.model, prompt, 48, drafter=drafter)
    assert torch.equal(first.tokens, plain) and torch.equal(second.tokens, plain)
    assert drafter.proposed["suffix"] > 0
    assert sum(drafter.proposed.values()) == len(first.steps) + len(second.steps)
