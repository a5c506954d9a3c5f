"""drafter.step=openvino (drafters/paged_drafts.py, drafters/paged_engine.py): the draft's
catch-ups and tree levels on OpenVINO's kernels give the PyTorch draft's states and logits, in
a batch of rows of different lengths, through two tree levels, after a rollback (EAGLE) and
after compaction (the draft model); each control (no tree mask, no compaction) fails the same
check; greedy decoding stays identical to plain decoding; what cannot run is refused by name."""

import pytest
import torch

import verify.runtime.openvino_step as openvino_step
from drafters import build_drafter
from drafters.engine import LevelRequest
from drafters.openvino_dflash import OpenVINODFlashDrafter, OpenVINODSparkDrafter
from drafters.paged_drafts import (
    OpenVINOMedusaDrafter,
    PagedDraftModelDrafter,
    PagedEagleDrafter,
    PagedPardDrafter,
)
from drafters.paged_engine import PagedDraftEngine
from verify.loop import generate
from verify.protocol import DraftContext
from verify.runtime.model import load_target
from verify.runtime.openvino_graph import UnsupportedModel
from verify.sampling import SamplingParams

TOLERANCE = 1e-4  # float32 kernels of another library sum in another order
PROMPTS = [torch.tensor([5, 9, 14, 3, 3, 27, 61, 8, 2, 40]), torch.tensor([7, 7, 31, 90]),
           torch.arange(40, 77)]
CHAIN = {"name": "chain2", "choices": [[0], [0, 0]]}
DRAFTERS = {"eagle1": {"name": "eagle", "draft_vocab_size": None},
            "eagle3": {"name": "eagle3", "draft_vocab_size": None},
            "draft_model": {"name": "draft_model", "num_layers": 1}}
DECODERS = {**DRAFTERS, "pard": {"name": "pard", "num_layers": 1, "block_size": 4},
            "medusa": {"name": "medusa", "num_heads": 3},
            "dflash": {"name": "dflash", "block_size": 4, "draft_vocab_size": None}}
PAGED = (PagedEagleDrafter, PagedDraftModelDrafter, PagedPardDrafter, OpenVINOMedusaDrafter,
         OpenVINODFlashDrafter)


@pytest.fixture(scope="module")
def targets():
    return {arch: (load_target(tiny=arch), load_target(tiny=arch, step="openvino"))
            for arch in ("llama", "qwen2")}


def twins(kind: str, target):
    """The same draft (one set of weights) on the PyTorch step and on OpenVINO's."""
    torch.manual_seed(0)
    paged = build_drafter(DRAFTERS[kind], CHAIN, target)
    eager = build_drafter({**DRAFTERS[kind], "step": "torch"}, CHAIN, target)
    if kind == "draft_model":
        eager.model = paged.model
    else:
        eager.draft = paged.draft
    for drafter in (paged, eager):
        drafter.begin_batch(list(PROMPTS))
    return paged, eager


def contexts(drafter, prompts, features_of) -> list[DraftContext]:
    params = SamplingParams()
    if not drafter.feature_layers:
        return [DraftContext(tokens, None, params) for tokens in prompts]
    # the features of every position the drafter has not read: all but the root's
    return [DraftContext(tokens, features_of(tokens)[:-1][int(length):], params)
            for tokens, length in zip(prompts, drafter.engine.lengths)]


def target_features(target, layers):
    def of(tokens):
        with torch.no_grad():
            states = target.model(tokens[None], output_hidden_states=True).hidden_states
        return torch.cat([states[i][0] for i in layers], dim=-1)
    return of


def close(a, b) -> float:
    return 0.0 if a is None and b is None else float((a - b).abs().max())


def two_levels(drafter, root_states):
    """Level 1: nodes 1, 2 under each row's root; level 2: node 3 under node 2 (row 0 and 2
    only). Returns both levels' answers."""
    first = drafter._forward_level({
        row: LevelRequest([[0, 1], [0, 2]], [11 + row, 12 + row],
                          None if root_states is None else root_states[row][None].repeat(2, 1))
        for row in range(len(PROMPTS))})
    second = drafter._forward_level({
        row: LevelRequest([[0, 2, 3]], [13 + row],
                          None if first[row][0] is None else first[row][0][1:2])
        for row in (0, 2)})
    return first, second


def one_step(drafter, target):
    """Catch-up over the prompts, two tree levels, then the accepted path 0 -> 2 -> 3 with a
    bonus token: committed (the draft model) or re-read from the target's features (EAGLE);
    then the second catch-up. Returns every answer's (states, logits)."""
    features_of = target_features(target, drafter.feature_layers)
    answers = [drafter._catch_up(contexts(drafter, PROMPTS, features_of))]
    first, second = two_levels(drafter, answers[0][0])
    answers += [first[row] for row in sorted(first)] + [second[row] for row in sorted(second)]
    accepted = [torch.cat([p, torch.tensor([12 + row, 13 + row, 50])])
                for row, p in enumerate(PROMPTS)]
    if drafter.commits_accepted_path:
        counts = drafter.engine.commit([[0, 2, 3]] * len(PROMPTS))  # row 1 fed no node 3
        drafter.cached_rows = [torch.cat([p, torch.tensor([12 + row, 13 + row])[:count]])
                               for row, (p, count) in enumerate(zip(PROMPTS, counts))]
    else:
        drafter.engine.rollback()
    answers.append(drafter._catch_up(contexts(drafter, accepted, features_of)))
    return answers


def largest_difference(kind, pair, monkeypatch=None) -> float:
    eager_target, paged_target = pair
    paged, eager = twins(kind, paged_target)
    with torch.no_grad():
        results = [one_step(eager, eager_target), one_step(paged, paged_target)]
    return max(max(close(a[0], b[0]), close(a[1], b[1])) for a, b in zip(*results))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_paged_draft_equals_the_pytorch_draft(kind, arch, targets):
    assert largest_difference(kind, targets[arch]) < TOLERANCE


def test_without_the_ancestor_mask_a_level_is_wrong(targets, monkeypatch):
    # the control: every fed node sees every node fed before it, as a chain would
    original = PagedDraftEngine._register

    def chain_path(self, row, paths, tokens, states):
        fed = original(self, row, paths, tokens, states)
        self.fed[row] = [node._replace(path=(0, *[n.node for n in fed[:i + 1]]))
                         for i, node in enumerate(fed)]
        return self.fed[row]
    monkeypatch.setattr(PagedDraftEngine, "_register", chain_path)
    assert largest_difference("eagle1", targets["llama"]) > 100 * TOLERANCE


def test_without_compaction_the_next_catch_up_is_wrong(targets, monkeypatch):
    # the control: the accepted nodes' entries stay where their tree put them
    monkeypatch.setattr(openvino_step.PagedState, "_move", lambda self, sources, targets: None)
    assert largest_difference("draft_model", targets["llama"]) > 100 * TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_paged_pard_block_equals_the_pytorch_block(arch, targets):
    # a block after the prompt, then after an accepted continuation (the masks' entries were
    # cropped, the new tokens fed after the kept ones), then after a rewound prompt
    eager_target, paged_target = targets[arch]
    config = {"name": "pard", "num_layers": 1, "block_size": 4}
    paged = build_drafter(config, CHAIN, paged_target)
    eager = build_drafter({**config, "step": "torch"}, CHAIN, eager_target)
    eager.draft = paged.draft
    assert isinstance(paged, PagedPardDrafter)
    longer = torch.cat([PROMPTS[0], torch.tensor([70, 71, 72])])
    for tokens in (PROMPTS[0], longer, PROMPTS[0][:6]):
        with torch.no_grad():
            expected, got = eager.marginals(tokens), paged.marginals(tokens)
        assert got.shape == (4, expected.shape[1])
        finite = expected.isfinite()
        assert torch.equal(finite, got.isfinite())
        assert (got[finite] - expected[finite]).abs().max() < TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_openvino_dflash_block_equals_the_pytorch_block(arch, targets, monkeypatch):
    # the prompt's context and block, then the accepted rows appended and the next block:
    # past the arrays' first capacity, so their growth is crossed too
    eager_target, paged_target = targets[arch]
    paged = build_drafter(DECODERS["dflash"], CHAIN, paged_target)
    eager = build_drafter({**DECODERS["dflash"], "step": "torch"}, CHAIN, eager_target)
    eager.draft = paged.draft
    assert isinstance(paged, OpenVINODFlashDrafter)
    assert largest_block_difference(eager, paged, eager_target) < TOLERANCE


def test_a_causal_dflash_block_is_caught(targets, monkeypatch):
    # the control: a causal block (what the paged kernel would give) is far off
    eager_target, paged_target = targets["llama"]
    paged = build_drafter(DECODERS["dflash"], CHAIN, paged_target)
    eager = build_drafter({**DECODERS["dflash"], "step": "torch"}, CHAIN, eager_target)
    eager.draft = paged.draft
    forward = paged.draft.forward

    def causal(tokens, positions, context, mask=None):
        held, n = context[0][0].shape[2], tokens.shape[1]
        allowed = torch.ones(n, held + n, dtype=torch.bool)
        allowed[:, held:] = torch.ones(n, n, dtype=torch.bool).tril()
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo().min)
        return forward(tokens, positions, context, additive[None, None])
    monkeypatch.setattr(eager.draft, "forward", causal)
    assert largest_block_difference(eager, paged, eager_target) > 100 * TOLERANCE


def largest_block_difference(eager, paged, target) -> float:
    features_of = target_features(target, paged.feature_layers)
    prompt = torch.arange(3, 70)  # 66 context rows: past the arrays' first 64
    longer = torch.cat([prompt, torch.tensor([70, 71, 72])])
    params = SamplingParams()
    steps = [DraftContext(prompt, features_of(prompt)[:-1], params),
             DraftContext(longer, features_of(longer)[len(prompt) - 1:-1], params)]
    largest = 0.0
    for ctx in steps:
        with torch.no_grad():
            expected, got = eager.block_marginals(ctx), paged.block_marginals(ctx)
        assert got.shape == expected.shape == (3, eager.draft.target_vocab_size)
        largest = max(largest, float((got - expected).abs().max()))
    return largest


@pytest.mark.parametrize("num_layers", [0, 2])
def test_openvino_medusa_heads_equal_the_pytorch_heads(num_layers, targets):
    eager_target, paged_target = targets["llama"]
    config = {"name": "medusa", "num_heads": 3, "num_layers": num_layers}
    tree = {"name": "tree6", "choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    torch.manual_seed(0)
    eager = build_drafter({**config, "step": "torch"}, tree, eager_target)
    for block in eager.heads.blocks.parameters():  # fresh blocks are zero: the identity
        block.data.normal_(0, 0.2)
    paged = OpenVINOMedusaDrafter(eager.heads, eager.topology, "medusa", paged_target.step)
    hidden = torch.randn(3, eager.heads.hidden_size)
    expected, got = eager._head_logits(hidden), paged._head_logits(hidden)
    assert got.shape == expected.shape == (3, 3, eager.heads.vocab_size)
    assert (got - expected).abs().max() < TOLERANCE


TREES = {"tree6": {"name": "tree6", "choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]},
         "eagle2": {"name": "eagle2", "depth": 3, "top_k": 3, "total_tokens": 6}}


@pytest.mark.parametrize("kind, tree", [(kind, tree) for kind in DECODERS for tree in TREES
                                        if (kind, tree) != ("medusa", "eagle2")])
def test_greedy_decoding_stays_identical_to_plain(kind, tree, targets):
    target = targets["qwen2"][1]
    drafter = build_drafter(DECODERS[kind], TREES[tree], target)
    assert isinstance(drafter, PAGED)
    plain = generate(target.step, PROMPTS[0], max_new_tokens=24).tokens
    out = generate(target.step, PROMPTS[0], max_new_tokens=24, drafter=drafter)
    assert torch.equal(out.tokens, plain)
    assert max(step.tree_size for step in out.steps) > 1, "the drafter never drafted"


def test_what_the_draft_step_cannot_run_is_refused_by_name(targets):
    eager_target, paged_target = targets["llama"]
    with pytest.raises(ValueError, match="set target.step=openvino"):
        build_drafter({"name": "eagle", "step": "openvino"}, CHAIN, eager_target)
    with pytest.raises(ValueError, match="drafter.step must be one of"):
        build_drafter({"name": "draft_model", "step": "gpu"}, CHAIN, paged_target)
    with pytest.raises(ValueError, match="inputs='tokens' runs on drafter.step=torch"):
        build_drafter({"name": "eagle", "inputs": "tokens"}, CHAIN, paged_target)
    gpt2 = load_target(tiny="gpt2")
    with pytest.raises(UnsupportedModel, match="gpt2"):
        PagedDraftModelDrafter(gpt2.model, build_drafter(DRAFTERS["draft_model"], CHAIN,
                                                         paged_target).tree,
                               "draft_model", paged_target.step)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_openvino_dspark_proposes_the_pytorch_trees(arch, targets):
    # DSpark's backbone on the DFlash graph (its outputs and base logits), its heads in
    # PyTorch: the same block outputs, and the same Markov-conditioned trees from them
    eager_target, paged_target = targets[arch]
    config = {"name": "dspark", "block_size": 4, "draft_vocab_size": None, "markov_rank": 8,
              "markov_init_std": 1.0}
    torch.manual_seed(0)
    paged = build_drafter(config, CHAIN, paged_target)
    eager = build_drafter({**config, "step": "torch"}, CHAIN, eager_target)
    eager.draft = paged.draft
    assert isinstance(paged, OpenVINODSparkDrafter)
    features_of = target_features(eager_target, paged.feature_layers)
    prompt = torch.arange(3, 30)
    ctx = DraftContext(prompt, features_of(prompt)[:-1], SamplingParams())
    with torch.no_grad():
        expected, got = eager.block_outputs(ctx), paged.block_outputs(ctx)
        for one, other in zip(expected, got):
            assert (one - other).abs().max() < TOLERANCE
        tree = {"total_tokens": 6, "policy": "ddtree"}
        trees = [build_drafter(config | {"step": step}, tree, target)
                 for step, target in (("torch", eager_target), ("openvino", paged_target))]
        trees[0].draft = trees[1].draft
        proposed = [drafter.propose(DraftContext(prompt, features_of(prompt)[:-1],
                                                 SamplingParams())) for drafter in trees]
    assert torch.equal(proposed[0].tokens, proposed[1].tokens)
    assert torch.equal(proposed[0].parents, proposed[1].parents)
