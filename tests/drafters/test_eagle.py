"""The EAGLE drafters: the draft network's shapes, tree levels against drafting one path at a
time, the feature contract, checkpoints and their refusal for another target."""

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.eagle import (
    EagleDraft,
    EagleDrafter,
    default_layout,
    eagle_config,
    load_draft,
    save_draft,
)
from drafters.engine import LevelRequest
from drafters.trees.dynamic import DynamicTree
from drafters.vocab import coverage, most_frequent_tokens
from verify.loop import generate, generate_batch
from verify.protocol import DraftContext
from verify.runtime.features import eagle3_layers
from verify.runtime.model import Target
from verify.sampling import SamplingParams
from verify.tree import TreeTopology

PROMPT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41])


def features(target: Target, tokens: torch.Tensor, layers) -> torch.Tensor:
    """(T, F * H) target features of `tokens`, as the verifier hands them over."""
    with torch.no_grad():
        states = target.model(tokens[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_draft_shapes(arch, variant, tiny):
    target = tiny(arch)
    layers = (-1,) if variant == "eagle1" else eagle3_layers(2)
    draft = EagleDraft(target.model, layers, vocab_ids=torch.arange(0, 256, 2),
                       layout=default_layout(variant))
    f = features(target, PROMPT, draft.feature_layers)  # (T, F * H)
    assert f.shape == (len(PROMPT), 64 * len(layers))
    inputs = draft.fuse_features(f)[None]
    hidden = draft(inputs, PROMPT[None], torch.arange(len(PROMPT))[None])
    assert hidden.shape == (1, len(PROMPT), 64)
    assert draft.logits(hidden).shape == (1, len(PROMPT), 128)
    # the target's token table is shared, not copied: the body's own is cut to one row (the
    # eagle3 layer has none)
    if variant == "eagle1":
        assert draft.body.get_input_embeddings().weight.shape[0] == 1
    else:
        assert not any("embed" in name for name, _ in draft.named_parameters())


def sequential_logits(drafter: EagleDrafter, ctx: DraftContext, path_tokens: list[int]):
    """Draft logits (V,) after the root and `path_tokens`, fed one node at a time."""
    hidden, logits = drafter._catch_up([ctx])
    hidden, logits = hidden[0], logits[0]
    for depth in range(1, len(path_tokens) + 1):
        path = list(range(depth + 1))  # a chain: node d is the d-th path token
        out, level_logits = drafter._forward_level(
            {0: LevelRequest([path], [path_tokens[depth - 1]], hidden[None])})[0]
        hidden, logits = out[0], level_logits[0]
    drafter.engine.rollback()
    return logits


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_tree_levels_equal_drafting_each_path_alone(variant, tiny):
    # tree masks and positions: every node's children are the top-k of the draft run along
    # that node's path alone
    target = tiny("llama")
    topology = TreeTopology.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    layers = (-1,) if variant == "eagle1" else eagle3_layers(2)
    drafter = EagleDrafter(EagleDraft(target.model, layers, layout=default_layout(variant)),
                           topology)
    ctx = DraftContext(PROMPT, features(target, PROMPT[:-1], drafter.feature_layers),
                       SamplingParams())
    tree = drafter.propose(ctx)
    assert len(tree) == topology.size
    for node in range(len(tree)):
        kids = tree.children(node)
        if not kids:
            continue
        path = tree.ancestor_mask()[node].nonzero().flatten().tolist()[1:]
        expected = sequential_logits(drafter, ctx, tree.tokens[path].tolist())
        assert tree.tokens[kids].tolist() == expected.topk(len(kids)).indices.tolist()


BATCH_TREES = {"static": TreeTopology.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0],
                                                    [0, 0, 0]]),
               "dynamic": DynamicTree(depth=3, top_k=3, total_tokens=6)}


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
@pytest.mark.parametrize("tree", BATCH_TREES, ids=list(BATCH_TREES))
def test_a_batch_drafts_each_rows_own_tree(variant, tree, tiny):
    # Four sequences of different lengths that accept different numbers of tokens per step
    # (so catch-ups of different sizes, stale cache slots, one row leaving): the batch's trees
    # are the ones each row's own drafter proposes alone. A row seeing another's or a stale
    # slot, or a wrong position, would change its draft logits and so its top-k children.
    target = tiny("llama")
    layers = (-1,) if variant == "eagle1" else eagle3_layers(2)
    draft = EagleDraft(target.model, layers, vocab_ids=torch.arange(0, 256, 2),
                       layout=default_layout(variant))
    batch, alone = EagleDrafter(draft, BATCH_TREES[tree]), [EagleDrafter(draft, BATCH_TREES[tree])
                                                            for _ in range(4)]
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 256, (40,), generator=generator) for _ in range(4)]
    feats = [features(target, sequence, draft.feature_layers) for sequence in sequences]
    lengths = [7, 3, 12, 5]  # tokens decided so far (the prompt and the first token)
    batch.begin_batch([s[:n - 1] for s, n in zip(sequences, lengths)])
    for single, sequence, n in zip(alone, sequences, lengths):
        single.begin(sequence[:n - 1])
    rows, cached = [0, 1, 2, 3], [0] * 4  # cached[b]: positions whose features were handed over
    for step, accepted in enumerate([[0, 0, 0, 0], [2, 0, 1, 3], [1, 3, 0, 2], [0, 2, 1, 1]]):
        if step == 2:  # row 1 finishes
            rows.remove(1)
            batch.keep_rows(torch.tensor([0, 2, 3]))
        ctxs = []
        for row in rows:
            lengths[row] += accepted[row] + (step > 0)
            ctxs.append(DraftContext(sequences[row][:lengths[row]],
                                     feats[row][cached[row]:lengths[row] - 1], SamplingParams()))
            cached[row] = lengths[row] - 1
        together = batch.propose_batch(ctxs)
        for row, ctx, tree_together in zip(rows, ctxs, together):
            tree_alone = alone[row].propose(ctx)
            assert torch.equal(tree_together.tokens, tree_alone.tokens), (step, row)
            assert torch.equal(tree_together.parents, tree_alone.parents), (step, row)
            assert len(tree_alone) > 3


def test_generate_batch_drafts_every_row_in_one_call(tiny, conf):
    # a batch drafter is asked once per step for all rows, never row by row
    target = tiny("llama")
    drafter = build_drafter(conf("drafter", "eagle"), conf("tree", "eagle2"), target)
    calls = []
    batch_propose = drafter.propose_batch
    drafter.propose_batch = lambda ctxs: calls.append(len(ctxs)) or batch_propose(ctxs)

    def alone(ctx):
        raise AssertionError("a batch drafter was asked for one row's tree")

    drafter.propose = alone
    prompts = [PROMPT, PROMPT[:6], PROMPT[2:]]
    results = generate_batch(target.model, prompts, 12, drafter=drafter)
    assert calls and calls[0] == 3 and len(calls) == max(len(r.steps) for r in results)
    for prompt, result in zip(prompts, results):
        assert torch.equal(result.tokens, generate(target.model, prompt, 12).tokens)


@pytest.mark.parametrize("tree", [TreeTopology.from_choices([[0], [1], [0, 0], [1, 0]]),
                                  DynamicTree(depth=3, top_k=3, total_tokens=8)],
                         ids=["static", "dynamic"])
def test_a_draft_vocabulary_is_all_it_proposes_and_decoding_stays_exact(tree, tiny):
    target = tiny("llama")
    even = torch.arange(0, 256, 2)  # a draft vocabulary of the even ids
    drafter = EagleDrafter(EagleDraft(target.model, (-1,), vocab_ids=even), tree)
    ctx = DraftContext(PROMPT, features(target, PROMPT[:-1], (-1,)), SamplingParams())
    proposed = drafter.propose(ctx)
    assert len(proposed) > 1 and bool((proposed.tokens[1:] % 2 == 0).all())
    plain = generate(target.model, PROMPT, 24).tokens
    assert torch.equal(generate(target.model, PROMPT, 24, drafter=drafter).tokens, plain)


def test_a_vocabulary_keeps_the_most_written_tokens_and_says_when_the_data_holds_fewer(caplog):
    sequences = [torch.tensor([5, 5, 5, 9, 9, 2]), torch.tensor([7, 9])]
    assert most_frequent_tokens(sequences, 2).tolist() == [5, 9]
    assert most_frequent_tokens(sequences, 3).tolist() == [2, 5, 9]  # 2 and 7 tie: lower id
    assert not caplog.records
    assert most_frequent_tokens(sequences, 8).tolist() == [2, 5, 7, 9]  # all there is
    assert "8 tokens asked for, the training data holds 4 distinct ones" in caplog.text
    assert most_frequent_tokens(sequences, None) is None  # the whole vocabulary


def test_vocabulary_coverage_counts_the_tokens_a_draft_can_propose():
    even = torch.arange(0, 256, 2)
    assert coverage(even, [torch.tensor([0, 1, 2]), torch.tensor([3, 4])]) == pytest.approx(0.6)
    assert coverage(None, [torch.tensor([1, 3])]) == 1.0  # the whole vocabulary


def test_missing_features_are_refused(tiny):
    target = tiny("llama")
    drafter = EagleDrafter(EagleDraft(target.model, (-1,)), TreeTopology.chain(2))
    with pytest.raises(ValueError, match="needs the target's features"):
        drafter.propose(DraftContext(PROMPT, None, SamplingParams()))
    drafter.begin(PROMPT)
    too_few = features(target, PROMPT[-4:-1], (-1,))  # rows for the last 3 positions only
    with pytest.raises(ValueError, match="call begin"):
        drafter.propose(DraftContext(PROMPT, too_few, SamplingParams()))


def test_checkpoint_round_trip_and_refusal_for_another_target(tiny, tmp_path):
    target = tiny("llama")
    draft = EagleDraft(target.model, eagle3_layers(2), vocab_ids=torch.arange(10, 200),
                       train_lm_head=True)
    save_draft(draft, tmp_path / "draft", target)
    loaded = load_draft(tmp_path / "draft", target)
    inputs, positions = torch.randn(1, 5, 64), torch.arange(5)[None]
    with torch.no_grad():
        assert torch.equal(loaded(inputs, PROMPT[None, :5], positions),
                           draft(inputs, PROMPT[None, :5], positions))
    assert loaded.hyperparameters == draft.hyperparameters
    other = Target(tiny("qwen2").model, None, "tiny-qwen2")
    with pytest.raises(ValueError, match="trained on 'tiny-llama'.*not on 'tiny-qwen2'"):
        load_draft(tmp_path / "draft", other)


def test_a_trained_checkpoint_decodes_through_build_drafter(tiny, tmp_path, conf):
    target = tiny("gpt2")
    save_draft(EagleDraft(target.model, (-1,)), tmp_path / "draft", target)
    cfg = OmegaConf.merge(conf("drafter", "eagle"), {"checkpoint": str(tmp_path / "draft")})
    drafter = build_drafter(cfg, conf("tree", "eagle2"), target)
    plain = generate(target.model, PROMPT, 20).tokens
    assert torch.equal(generate(target.model, PROMPT, 20, drafter=drafter).tokens, plain)


@pytest.mark.parametrize("saved, asked, hint", [("eagle1", "eagle3", "drafter=eagle"),
                                                ("eagle3", "eagle", "drafter=eagle3")])
def test_a_checkpoint_of_the_other_eagle_is_refused_by_name(tiny, tmp_path, conf, saved, asked,
                                                           hint):
    target = tiny("llama")
    layers, layout = ((-1,), "fused_input") if saved == "eagle1" else (eagle3_layers(2), "eagle3")
    draft = EagleDraft(target.model, layers, layout=layout)
    assert draft.variant == saved
    save_draft(draft, tmp_path / "draft", target)
    cfg = OmegaConf.merge(conf("drafter", asked), {"checkpoint": str(tmp_path / "draft")})
    with pytest.raises(ValueError, match=f"holds an {saved} draft .* load it with {hint}$"):
        build_drafter(cfg, conf("tree", "chain4"), target)
    # an EAGLE-3 ablation on the last layer alone keeps EAGLE-3's layer: still EAGLE-3
    assert EagleDraft(target.model, (-1,), layout="eagle3").variant == "eagle3"


@pytest.mark.parametrize("inputs", ["tokens", "features"])
def test_an_input_ablation_ignores_the_dropped_input_and_round_trips(inputs, tiny, tmp_path):
    target = tiny("llama")
    draft = EagleDraft(target.model, (-1,), inputs=inputs)
    positions = torch.arange(5)[None]
    feats, other_feats = torch.randn(2, 1, 5, 64)
    tokens, other_tokens = PROMPT[None, :5], PROMPT[None, 5:10]
    with torch.no_grad():
        base = draft(feats, tokens, positions)
        kept_changed = (draft(other_feats, tokens, positions) if inputs == "features"
                        else draft(feats, other_tokens, positions))
        dropped_changed = (draft(feats, other_tokens, positions) if inputs == "features"
                           else draft(other_feats, tokens, positions))
    assert torch.equal(dropped_changed, base) and not torch.allclose(kept_changed, base)
    save_draft(draft, tmp_path / "draft", target)
    assert load_draft(tmp_path / "draft", target).inputs == inputs
    plain = generate(target.model, PROMPT, 16).tokens
    drafter = EagleDrafter(draft, TreeTopology.chain(3))
    assert torch.equal(generate(target.model, PROMPT, 16, drafter=drafter).tokens, plain)


def test_config_keys_are_typed(conf):
    assert eagle_config(conf("drafter", "eagle3")).ttt_steps == 3
    with pytest.raises(ValueError, match=r"unknown EAGLE setting\(s\) \['ttt_step'\]"):
        eagle_config({"name": "eagle", "ttt_step": 2})
    with pytest.raises(ValueError, match="variant must be one of"):
        eagle_config({"name": "eagle", "variant": "eagle2"})
    with pytest.raises(ValueError, match="inputs must be one of"):
        eagle_config({"name": "eagle", "inputs": "token"})


@pytest.mark.parametrize("tree", ["chain4", "eagle2"])
def test_the_end_of_a_learned_position_table_is_decoded_plainly(tree, tiny, conf):
    # GPT-2's draft body has 512 learned positions: trees that would pass them are not grown
    target = tiny("gpt2")
    prompt = torch.arange(500) % 200
    drafter = build_drafter(conf("drafter", "eagle"), conf("tree", tree), target)
    result = generate(target.model, prompt, 12, drafter=drafter)
    assert torch.equal(result.tokens, generate(target.model, prompt, 12).tokens)
    assert result.steps[-1].tree_size == 1
