"""DFlash training on tiny targets: the block mask, anchors, rows and weights of the loss, the
training forward equals what the drafter computes when decoding, the loss falls, a resumed run
ends where an uninterrupted one does, another target's checkpoint is refused; and the LK
losses (optim.loss) against hand computations, in both EAGLE's and DFlash's objectives."""

import math
from functools import partial

import pytest
import torch

import train.dflash as dflash_loss_module
import train.recipes.dflash as dflash_recipe
from drafters.dflash import DFlashConfig, DFlashDraft, DFlashDrafter, block_mask
from drafters.eagle import EagleConfig, EagleDraft
from train import run_training
from train.dflash import DFlashLoss, block_rows, position_weights, sample_anchors
from train.eagle import EagleLoss
from train.losses import RowLoss
from verify.runtime.features import eagle3_layers
from verify.runtime.model import load_target
from verify.tree import TreeTopology

TOKENS = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 7, 9])


def _features(target, tokens, layers):
    with torch.no_grad():
        states = target.model(tokens[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


def _objective(block_size=4, anchors=16, kind="ce", decay=4.0):
    """A fresh draft on the tiny Llama, its objective, and a one-sequence batch."""
    torch.manual_seed(0)
    target = load_target(tiny="llama")
    draft = DFlashDraft(target.model, eagle3_layers(2), block_size, 1)
    config = DFlashConfig(block_size=block_size, anchors=anchors, loss_decay=decay)
    objective = DFlashLoss(draft, target.model.get_output_embeddings(), config, RowLoss(kind))
    features = _features(target, TOKENS, (*draft.feature_layers, 2))  # + the last state
    return objective, {"input_ids": TOKENS[None], "features": features[None],
                       "learn": torch.ones(1, len(TOKENS), dtype=torch.bool)}


def test_a_block_sees_the_context_before_its_anchor_and_its_own_block_only():
    starts, valid = torch.tensor([[2, 5, 0]]), torch.tensor([[True, True, False]])
    allowed = block_mask(starts, valid, 8, 2, torch.float32)[0, 0] == 0  # (6, 8 + 6)
    seen = [allowed[row].nonzero().flatten().tolist() for row in range(6)]
    assert seen[0] == seen[1] == [0, 1, 8, 9]  # anchor 2: positions 0, 1 and its block
    assert seen[2] == seen[3] == [0, 1, 2, 3, 4, 10, 11]  # anchor 5: 0..4, never block 0
    assert seen[4] == seen[5] == [12, 13]  # invalid: itself only


def test_anchors_are_positions_whose_next_token_is_learned_and_reproducible():
    learn = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    draws = [sample_anchors(learn, 3, torch.Generator().manual_seed(5)) for _ in range(2)]
    starts, valid = draws[0]
    assert torch.equal(starts, draws[1][0]) and torch.equal(valid, draws[1][1])
    # eligible: a >= 1 with learn[a + 1] (row 0: 1, 2, 4, 5; row 1: 5, 6 only)
    assert set(starts[0].tolist()) <= {1, 2, 4, 5} and valid[0].all()
    assert sorted(starts[1][valid[1]].tolist()) == [5, 6] and valid[1].sum() == 2
    assert len(set(starts[0].tolist())) == 3  # distinct


def test_rows_past_the_end_or_not_learned_do_not_count():
    learn = torch.tensor([[1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    rows = block_rows(learn, torch.tensor([[1, 3, 0]]), torch.tensor([[True, True, False]]), 3)
    # anchor 1 predicts 2, 3, 4 (4 not learned); anchor 3 predicts 4, 5, 6 (6 past the end)
    assert rows.tolist() == [[[True, True, False], [False, True, False], [False] * 3]]
    assert position_weights(3, 2.0, torch.device("cpu")).tolist() == pytest.approx(
        [1.0, math.exp(-0.5), math.exp(-1.0)])


@pytest.mark.parametrize("kind", ["ce", "lk", "lk_hybrid"])
def test_the_loss_is_the_weighted_mean_of_its_rows_targets_and_all(monkeypatch, kind):
    objective, batch = _objective(block_size=4, kind=kind, decay=2.0)
    starts, valid = torch.tensor([[3, 11, 0]]), torch.tensor([[True, True, False]])
    monkeypatch.setattr(dflash_loss_module, "sample_anchors", lambda *args: (starts, valid))
    batch["learn"][0, 5] = False
    loss, counts = objective(**batch)
    with torch.no_grad():
        logits = objective.block_logits(batch["input_ids"], batch["features"], starts, valid)
    head = objective.target_head.weight
    total, rows = 0.0, [0, 0, 0]
    for j, k in [(0, 1), (0, 3), (1, 1), (1, 2)]:  # (3, 2) is token 5, unlearned; 11 + 3 past
        anchor = int(starts[0, j])
        p = (batch["features"][0, anchor + k - 1, -64:] @ head.T).softmax(-1)
        q = logits[0, j, k - 1].softmax(-1)
        alpha = torch.minimum(p, q).sum()
        kl = (p * (p.clamp_min(1e-45).log() - q.log())).sum()
        mix = math.exp(-3.0 * float(alpha.detach()))
        value = {"ce": -(p * q.log()).sum(), "lk": -alpha.log(),
                 "lk_hybrid": mix * kl + (1 - mix) * (1 - alpha)}[kind]
        total += math.exp(-(k - 1) / 2.0) * float(value)
        rows[k - 1] += 1
    assert counts[:, 0].tolist() == rows
    assert float(loss.detach()) == pytest.approx(total / 4, rel=1e-4)


def test_the_training_forward_is_what_the_drafter_computes_when_decoding():
    objective, batch = _objective(block_size=4)
    draft = objective.draft.eval()
    starts, valid = torch.tensor([[1, 6, 10]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        logits = objective.block_logits(batch["input_ids"], batch["features"], starts, valid)
    for j, anchor in enumerate(starts[0].tolist()):
        drafter = DFlashDrafter(draft, TreeTopology.chain(3))
        context = batch["features"][:, :anchor, :objective.input_width]
        drafter._context = draft.context(context, torch.arange(anchor)[None])
        with torch.no_grad():
            _, block = drafter.outputs(int(TOKENS[anchor]), anchor)
        torch.testing.assert_close(logits[0, j], block, atol=1e-4, rtol=1e-3)


def test_training_steps_lower_the_loss(descend):
    objective, batch = _objective(block_size=4, anchors=16)  # every eligible anchor
    losses, counts = descend(objective, objective.draft, batch, 8)
    assert counts.shape == (3, 4)
    assert losses[-1] < losses[0] * 0.8, losses


def test_lk_losses_on_hand_made_distributions():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q_logits = torch.tensor([[0.25, 0.25, 0.5], [0.2, 0.3, 0.5]]).log()
    lam = math.exp(-3.0 * 0.5)
    expected = {"ce": [math.log(4), None], "lk": [math.log(2), 0.0],
                "lk_hybrid": [lam * math.log(2) + (1 - lam) * 0.5, 0.0]}
    for kind, (first, second) in expected.items():
        loss, alpha = RowLoss(kind)(p, q_logits)
        assert alpha.tolist() == pytest.approx([0.5, 1.0])  # identical p and q: accepted
        assert float(loss[0]) == pytest.approx(first, rel=1e-5)
        if second is not None:
            assert float(loss[1]) == pytest.approx(second, abs=1e-6)


def test_lk_hybrid_holds_its_mix_constant():
    # lambda = exp(-eta alpha) is a weight, not a path for the gradient
    p = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.tensor([0.1, 0.5, -0.2], requires_grad=True)
    loss, alpha = RowLoss("lk_hybrid", eta=2.0)(p, logits)
    loss.backward()
    q = logits.detach().clone().requires_grad_(True)
    mix = math.exp(-2.0 * float(alpha))
    log_q = q.log_softmax(-1)
    by_hand = mix * (p * (p.log() - log_q)).sum() + (1 - mix) * 0.5 * (p - log_q.exp()).abs().sum()
    by_hand.backward()
    torch.testing.assert_close(logits.grad, q.grad)


@pytest.mark.parametrize("kind", ["lk", "lk_hybrid"])
def test_the_lk_losses_reach_eagles_objective(kind):
    torch.manual_seed(0)
    target = load_target(tiny="llama")
    draft = EagleDraft(target.model, eagle3_layers(2))
    config = EagleConfig(ttt_steps=1, noise=0.0, feature_weight=0.0, ce_weight=1.0)
    head = target.model.get_output_embeddings()
    features = _features(target, TOKENS, (*draft.feature_layers, 2))[None]
    batch = {"input_ids": TOKENS[None], "features": features,
             "learn": torch.ones(1, len(TOKENS), dtype=torch.bool)}
    losses = {k: float(EagleLoss(draft, head, config, RowLoss(k))(**batch)[0].detach())
              for k in ("ce", kind)}
    objective = EagleLoss(draft, head, config)
    inputs, tokens, states, rows = objective._rows(*batch.values())
    hidden = next(objective.unroll(inputs, tokens, 1))
    p = objective.target_head(states).softmax(-1)
    per_row = RowLoss(kind)(p, draft.logits(hidden).float())[0]
    assert losses[kind] == pytest.approx(float(per_row[rows].mean().detach()), rel=1e-5)
    assert losses[kind] != pytest.approx(losses["ce"])


def test_an_unknown_loss_is_refused_by_name(train_cfg):
    with pytest.raises(ValueError, match="optim.loss must be one of .* got 'bogus'"):
        run_training(train_cfg("drafter=dflash", "optim.loss=bogus"))
    with pytest.raises(ValueError, match="'bogus'"):
        RowLoss("bogus")


@pytest.mark.parametrize("decay", ["0", "-1", "nan"])
def test_a_loss_decay_that_is_not_positive_is_refused_before_anything_loads(
        train_cfg, monkeypatch, decay):
    def no_target(*args):
        raise AssertionError("the target was loaded")
    monkeypatch.setattr(dflash_recipe.common, "training_target", no_target)
    with pytest.raises(ValueError, match=f"drafter.loss_decay must be > 0 .* got {decay}"):
        run_training(train_cfg("drafter=dflash", f"drafter.loss_decay={decay}"))


def test_a_smoke_run_trains_with_the_configured_loss_and_reports_acceptance(
        train_cfg, monkeypatch):
    built = []

    def recording(*args):
        built.append(DFlashLoss(*args))
        return built[-1]
    monkeypatch.setattr(dflash_recipe, "DFlashLoss", recording)
    results = run_training(train_cfg("drafter=dflash", "optim.loss=lk"))
    assert built[0].row_loss == RowLoss("lk", 3.0)
    accuracy = results["accuracy"]
    assert len(accuracy["top1"]) == len(accuracy["alpha"]) == 3  # smoke: blocks of 4
    assert all(0 < a <= 1 for a in accuracy["alpha"])
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]


def test_a_resumed_run_ends_in_the_uninterrupted_runs_state(train_cfg, resumes_exactly,
                                                            tmp_path):
    run_training(train_cfg("drafter=dflash", out="whole"))
    resumes_exactly(partial(train_cfg, "drafter=dflash"), tmp_path, "draft.safetensors")


def test_resuming_refuses_another_target(train_cfg):
    run_training(train_cfg("drafter=dflash"))
    with pytest.raises(ValueError, match="belongs to 'tiny-llama', not 'tiny-qwen2'"):
        run_training(train_cfg("drafter=dflash", "target=tiny_qwen2"))
