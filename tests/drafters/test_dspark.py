"""DSpark (drafters.dspark): with its Markov head off it is DFlash's block; each drafted node
proposes its children from its own token's row; best-first over those rows keeps the best
paths; the confidence schedule cuts chains where it should; checkpoints load only where they
belong; greedy decoding with a strong random Markov head is the target's, on every tree.
Exactness under sampling: tests/experiments/test_correctness.py (dspark cases)."""

import itertools
import math

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.dflash import DFlashDraft, DFlashDrafter, save_draft
from drafters.dspark import DSparkDraft, DSparkDrafter, MarkovRows, dspark_tree
from drafters.trees.confidence import ConfidenceChain
from drafters.trees.cost import StepCost
from drafters.trees.ddtree import DDTree, best_first_over
from drafters.trees.dynamic import DynamicTree
from verify.loop import generate
from verify.protocol import DraftContext
from verify.runtime.features import eagle3_layers, num_layers
from verify.sampling import SamplingParams, warp
from verify.tree import TokenTree, TreeError, TreeTopology

T1, GREEDY = SamplingParams(1.0), SamplingParams()


def dspark(model, rank=8, init=1.0, confidence=True, vocab_ids=None) -> DSparkDraft:
    torch.manual_seed(0)
    layers = eagle3_layers(num_layers(model.config))
    return DSparkDraft(model, layers, 4, 1, vocab_ids, rank, confidence, init).eval()


def test_with_its_markov_head_off_the_block_is_dflash(tiny):
    model = tiny("llama").model
    torch.manual_seed(1)
    dflash = DFlashDraft(model, eagle3_layers(num_layers(model.config)), 4, 1)
    spark = dspark(model, init=0.0)  # W2 zero: the bias is nothing
    missing = spark.load_state_dict(dflash.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["confidence.weight", "markov_w1.weight", "markov_w2.weight"]
    base = torch.randn(3, spark.vocab_size)
    rows = MarkovRows(spark, base)
    assert torch.equal(rows.draft_logits([0, 1, 2], [5, 6, 7]), base)
    # and a trained head does move them: the control
    strong = dspark(model, init=1.0)
    assert not torch.allclose(MarkovRows(strong, base).draft_logits([0], [5]), base[:1])


def test_each_node_draws_its_children_from_its_own_tokens_row(tiny):
    draft = dspark(tiny("llama").model)
    base = 2 * torch.randn(3, draft.vocab_size, generator=torch.Generator().manual_seed(3))
    topology = TreeTopology.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tree = dspark_tree(draft, topology, 5, torch.zeros(3, 64), base, T1,
                       torch.Generator().manual_seed(0))
    rows = MarkovRows(draft, base)
    for node in range(len(tree)):
        if tree.children(node):
            expected = warp(rows.logits([int(tree.depths[node])], [int(tree.tokens[node])])[0], T1)
            assert torch.allclose(tree.draft_probs[node], expected)
    # siblings' children come from different rows: the head is conditioning
    first, second = tree.children(0)[:2]
    assert not torch.allclose(tree.draft_probs[first], tree.draft_probs[second])


def test_greedy_chains_follow_each_tokens_best_next_token(tiny):
    draft = dspark(tiny("llama").model)
    base = torch.randn(3, draft.vocab_size, generator=torch.Generator().manual_seed(4))
    chain = dspark_tree(draft, TreeTopology.chain(3), 5, torch.zeros(3, 64), base, GREEDY)
    rows, previous = MarkovRows(draft, base), 5
    for depth, token in enumerate(chain.tokens[1:].tolist()):
        assert token == int(rows.logits([depth], [previous])[0].argmax())
        previous = token


@pytest.mark.parametrize("budget", [1, 4, 9])
def test_best_first_over_conditional_rows_keeps_the_best_paths(budget):
    vocab, depth = 4, 3
    table = torch.randn(depth, vocab, vocab, generator=torch.Generator().manual_seed(5))
    log_probs = table.log_softmax(-1)  # [depth, parent token, child token]

    def ranked(d, token):
        values, tokens = log_probs[d, token].topk(vocab)
        return values.tolist(), tokens.tolist()
    tree = best_first_over(2, ranked, depth, budget).build()

    def score(path):
        parents = (2, *path[:-1])
        return sum(float(log_probs[d, parents[d], path[d]]) for d in range(len(path)))
    every = [score(path) for length in range(1, depth + 1)
             for path in itertools.product(range(vocab), repeat=length)]
    mask = tree.ancestor_mask()
    kept = sorted((score(tuple(tree.tokens[mask[n]][1:].tolist())) for n in range(1, len(tree))),
                  reverse=True)
    assert kept == pytest.approx(sorted(every, reverse=True)[:budget])


def test_confidence_chains_are_cut_by_threshold_and_by_cost(tiny):
    draft = dspark(tiny("llama").model)
    base = torch.randn(3, draft.vocab_size)
    hidden = torch.randn(3, 64)
    with torch.no_grad():
        full = dspark_tree(draft, ConfidenceChain(threshold=1e-9), 5, hidden, base, GREEDY)
    assert len(full) == 4 and full.draft_probs is None  # one-hot proposals
    survival = full.scores[1:].tolist()
    assert all(a >= b for a, b in zip(survival, survival[1:]))  # a product of chances
    with torch.no_grad():
        cut = dspark_tree(draft, ConfidenceChain(threshold=survival[1]), 5, hidden, base, GREEDY)
    assert len(cut) == 3 and torch.equal(cut.tokens, full.tokens[:3])
    # verifying costs nothing more: keep all; costs a lot more per token: decode plainly
    flat = StepCost({1: 10.0, 8: 10.0})
    steep = StepCost({1: 10.0, 2: 1000.0})
    with torch.no_grad():
        assert len(dspark_tree(draft, ConfidenceChain(cost=flat), 5, hidden, base, GREEDY)) == 4
        assert len(dspark_tree(draft, ConfidenceChain(cost=steep), 5, hidden, base, GREEDY)) == 1
    with pytest.raises(TreeError, match="give exactly one"):
        ConfidenceChain()


def test_the_confidence_tree_needs_a_confidence_head(tiny, conf):
    target = tiny("llama")
    tree = OmegaConf.merge(conf("tree", "confidence"), {"cost": None, "threshold": 0.5})
    with pytest.raises(TreeError, match="drafter 'dflash' has none.*dspark"):
        build_drafter(conf("drafter", "dflash"), tree, target)
    with pytest.raises(TreeError, match="lacks"):
        build_drafter(OmegaConf.merge(conf("drafter", "dspark"), {"confidence_head": False}),
                      tree, target)


def test_checkpoints_load_only_where_they_belong(tiny, conf, tmp_path):
    target = tiny("llama")
    draft = dspark(target.model)
    save_draft(draft, tmp_path / "spark", target)
    loaded = build_drafter(OmegaConf.merge(conf("drafter", "dspark"), {
        "checkpoint": str(tmp_path / "spark"), "block_size": 4, "step": "torch"}),
        conf("tree", "chain2"), target)
    for name, value in draft.state_dict().items():
        assert torch.equal(loaded.draft.state_dict()[name], value), name
    dflash = DFlashDraft(target.model, draft.feature_layers, 4, 1)
    save_draft(dflash, tmp_path / "flash", target)
    with pytest.raises(ValueError, match="holds a DFlash draft.*the DSpark drafter needs"):
        build_drafter(OmegaConf.merge(conf("drafter", "dspark"), {
            "checkpoint": str(tmp_path / "flash"), "block_size": 4}), conf("tree", "chain2"),
            target)
    with pytest.raises(ValueError, match="holds a DSpark draft.*the DFlash drafter needs"):
        build_drafter(OmegaConf.merge(conf("drafter", "dflash"), {
            "checkpoint": str(tmp_path / "spark"), "block_size": 4}), conf("tree", "chain2"),
            target)


@pytest.mark.parametrize("key, value", [("markov_rank", -1), ("markov_init_std", -0.5),
                                        ("l1_weight", -1.0)])
def test_bad_settings_are_refused_by_name(tiny, conf, key, value):
    with pytest.raises(ValueError, match=f"drafter.{key}"):
        build_drafter(OmegaConf.merge(conf("drafter", "dspark"), {key: value}),
                      conf("tree", "chain2"), tiny("llama"))


TREES = {"chain": TreeTopology.chain(3),
         "tree": TreeTopology.from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
         "ddtree": DDTree(6), "dynamic": DynamicTree(3, 2, 5),
         "confidence": ConfidenceChain(threshold=1e-6)}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_with_a_strong_markov_head_is_the_targets(tiny, arch, tree):
    target = tiny(arch)
    drafter = DSparkDrafter(dspark(target.model, init=2.0), TREES[tree])
    prompt = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41])
    plain = generate(target.model, prompt, 30)
    spec = generate(target.model, prompt, 30, drafter=drafter)
    assert torch.equal(spec.tokens, plain.tokens)
    assert max(step.tree_size for step in spec.steps) > 1 and math.isfinite(spec.tau)


def test_a_step_proposes_from_one_block_forward(tiny):
    target = tiny("llama")
    drafter = DSparkDrafter(dspark(target.model), TREES["tree"])
    width = drafter.draft.fc.weight.shape[1]
    ctx = DraftContext(torch.arange(5, 16), torch.randn(10, width), T1,
                       torch.Generator().manual_seed(0))
    tree = drafter.propose(ctx)
    assert drafter.forwards == 1 and isinstance(tree, TokenTree) and len(tree) == 6


class ProposedTokens:
    """`drafter` with every tree it proposes recorded: `tokens` the drafted ones (root left
    out), over a whole decode."""

    def __init__(self, drafter):
        self.drafter, self.tokens = drafter, []
        self.feature_layers, self.target_top_k = drafter.feature_layers, drafter.target_top_k

    def begin(self, prompt):
        self.drafter.begin(prompt)

    def propose(self, ctx):
        tree = self.drafter.propose(ctx)
        self.tokens.append(tree.tokens[1:])
        return tree

    def update(self, tree, acceptance):
        self.drafter.update(tree, acceptance)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("tree", ["chain", "ddtree", "confidence"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_block_drafts_vocabulary_is_all_it_proposes_and_greedy_stays_exact(tiny, kind, tree,
                                                                            temperature):
    # the draft vocabulary of the even ids: no tree, greedy or sampled, holds an odd one
    if kind == "dflash" and tree == "confidence":
        pytest.skip("the confidence tree is DSpark's own")
    target = tiny("llama")
    even = torch.arange(0, 256, 2)
    if kind == "dspark":
        drafter = DSparkDrafter(dspark(target.model, init=2.0, vocab_ids=even), TREES[tree])
    else:
        torch.manual_seed(0)
        drafter = DFlashDrafter(DFlashDraft(target.model, eagle3_layers(2), 4, 1, even).eval(),
                                TREES[tree])
    recorded = ProposedTokens(drafter)
    prompt = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41])
    params = SamplingParams(temperature=temperature)
    result = generate(target.model, prompt, 30, drafter=recorded, sampling=params,
                      generator=torch.Generator().manual_seed(0))
    drafted = torch.cat(recorded.tokens)
    assert len(drafted) >= 20 and bool((drafted % 2 == 0).all())
    if temperature == 0:
        assert torch.equal(result.tokens, generate(target.model, prompt, 30).tokens)
