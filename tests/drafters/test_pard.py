"""PARD's drafter and its training layout on tiny targets: the masks never stay in the draft
cache, the block's rows are what a causal forward over [context, root, masks] gives, the
training mask is the paper's, and what does not fit is refused by name."""

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.block import MASK
from drafters.draft_model import save_draft_model, truncated_copy
from drafters.pard import PardConfig, PardDraft, mean_embedding, pard_config, write_mask
from train.pard import block_layout, layout_mask
from verify.runtime.model import load_target
from verify.tree import TreeError

CONTEXT = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41])


def drafter(target, tree="chain4", **overrides):
    cfg = {**OmegaConf.load("conf/drafter/pard.yaml"), "num_layers": 1, **overrides}
    return build_drafter(cfg, OmegaConf.load(f"conf/tree/{tree}.yaml"), target)


def test_a_steps_block_equals_a_fresh_drafts_on_the_same_context():
    target = load_target(tiny="llama")
    stepped = drafter(target)
    stepped.marginals(CONTEXT[:6])
    first = stepped.marginals(CONTEXT[:8])  # the masks of the step before are gone
    assert stepped.cache.get_seq_length() == 8 and torch.equal(stepped.cached, CONTEXT[:8])
    fresh = drafter(target)
    torch.testing.assert_close(first, fresh.marginals(CONTEXT[:8]))
    # another sequence (a shorter, different context): the cache is cut back, not reused
    other = torch.tensor([40, 41, 9, 9, 9])
    torch.testing.assert_close(stepped.marginals(other), drafter(target).marginals(other))


def test_the_block_is_a_causal_forward_over_context_root_and_masks():
    target = load_target(tiny="qwen2")
    d = drafter(target, "chain2", block_size=3)
    draft = d.draft
    tokens = torch.cat([CONTEXT, torch.tensor([MASK, MASK])])
    with torch.no_grad():
        whole = draft(tokens[None], torch.arange(len(tokens))[None])[0, -3:]
        self_draft = truncated_copy(target.model, 1)(CONTEXT[None]).logits[0, -1]
    marginals = d.marginals(CONTEXT)
    assert marginals.shape == (3, 256)
    torch.testing.assert_close(marginals, whole.float())
    torch.testing.assert_close(marginals[0], self_draft.float())  # depth 1: the plain draft
    assert not torch.allclose(marginals[1], marginals[2])  # the masks see different things


def test_paper_attention_layout_on_a_hand_made_sequence():
    anchors, offsets = block_layout(5, 3)
    # 5 real tokens, masks g=1 for anchors 0..2 (token t+2 < 5), g=2 for anchors 0..1
    assert anchors.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert offsets.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]
    seen = layout_mask(anchors, offsets, torch.float32)[0, 0] == 0
    names = [f"{'x' if g == 0 else 'm'}{t}.{g}" for t, g in zip(anchors.tolist(), offsets.tolist())]

    def sees(query):
        return {names[k] for k in seen[names.index(query)].nonzero().flatten().tolist()}
    assert sees("x2.0") == {"x0.0", "x1.0", "x2.0"}  # causal over the real tokens
    assert sees("m1.1") == {"x0.0", "x1.0", "m1.1"}
    # mask 2 after anchor 1: the prefix through its anchor and its own anchor's masks only
    assert sees("m1.2") == {"x0.0", "x1.0", "m1.1", "m1.2"}
    assert sees("m0.2") == {"x0.0", "m0.1", "m0.2"}


def test_conditional_drop_keeps_each_masks_chain_and_shrinks_by_offset():
    generator = torch.Generator().manual_seed(0)
    anchors, offsets = block_layout(40, 5, keep_ratio=0.5, keep_min=0.1, generator=generator)
    kept = {g: set(anchors[offsets == g].tolist()) for g in range(5)}
    assert [len(kept[g]) for g in range(5)] == [40, 20, 10, 5, 4]  # ceil(40 * max(0.5^g, 0.1))
    for g in range(2, 5):  # a kept mask's earlier masks are there for it to see
        assert kept[g] <= kept[g - 1]
    again = block_layout(40, 5, 0.5, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], anchors)


def test_a_checkpoint_for_another_block_size_is_refused_by_name(tmp_path):
    target = load_target(tiny="llama")
    model = truncated_copy(target.model, 1)
    draft = PardDraft(model, 4, None, mean_embedding(model))
    save_draft_model(model, None, tmp_path, target, {},
                     extra=lambda tmp: write_mask(tmp, draft))
    assert drafter(target, path=str(tmp_path), block_size=4).draft.block_size == 4
    with pytest.raises(ValueError, match="trained with block_size 4.*drafter.block_size=4"):
        drafter(target, path=str(tmp_path), block_size=8)


def test_a_plain_draft_folder_or_another_vocabulary_is_refused(tmp_path):
    target = load_target(tiny="llama")
    save_draft_model(truncated_copy(target.model, 1), None, tmp_path / "plain", target, {})
    with pytest.raises(ValueError, match="holds no PARD draft .*drafter.path="):
        drafter(target, path=str(tmp_path / "plain"))
    # a draft whose ids stop at 200: draft_model's own checks refuse it
    model = truncated_copy(load_target(tiny="llama").model, 1)
    model.resize_token_embeddings(200)
    draft = PardDraft(model, 8, None, mean_embedding(model))
    save_draft_model(model, None, tmp_path / "small", target, {},
                     extra=lambda tmp: write_mask(tmp, draft))
    with pytest.raises(ValueError, match="vocab_size 200"):
        drafter(target, path=str(tmp_path / "small"))


def test_trees_deeper_than_the_block_and_bad_settings_are_refused():
    target = load_target(tiny="llama")
    # PARD's block drafts block_size positions (the root's next and k - 1 masks'), one more
    # than DFlash's: the message names that limit, for static and dynamic trees alike
    assert drafter(target, "chain4", block_size=4).tree.depth == 4
    limit = r"exceeds what pard can fill: its block drafts 4 positions \(drafter\.block_size\)"
    for tree in ("tree16", "eagle2"):  # 5 deep
        with pytest.raises(TreeError, match=limit):
            drafter(target, tree, block_size=4)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        pard_config({"block_size": 1})
    with pytest.raises(ValueError, match="no i.i.d. mode"):
        pard_config({"iid_siblings": True})
    with pytest.raises(ValueError, match="unknown PARD setting"):
        pard_config({"blocksize": 4})
    assert pard_config({}) == PardConfig()
