"""DSpark training (train.dspark): its three terms against a hand computation, the Markov head
teacher-forced with the sequence's tokens (or the caller's), the training forward equals what
the drafter computes when decoding, the loss falls, a resumed run ends where an uninterrupted
one does, and a smoke run reports per-position acceptance."""

from functools import partial

import pytest
import torch
from torch import nn

from drafters.dspark import DSparkConfig, DSparkDraft, DSparkDrafter, MarkovRows
from train import run_training
from train.dspark import DSparkLoss, teacher_previous
from verify.runtime.features import eagle3_layers
from verify.runtime.model import load_target
from verify.tree import TreeTopology

TOKENS = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 7, 9])


def _objective(config=None, init=0.5):
    torch.manual_seed(0)
    target = load_target(tiny="llama")
    config = config or DSparkConfig(block_size=4, anchors=16, markov_rank=8)
    draft = DSparkDraft(target.model, eagle3_layers(2), config.block_size, 1, None,
                        config.markov_rank, config.confidence_head, init)
    objective = DSparkLoss(draft, target.model.get_output_embeddings(), config)
    with torch.no_grad():
        states = target.model(TOKENS[None], output_hidden_states=True).hidden_states
    features = torch.cat([states[i][0] for i in (*draft.feature_layers, 2)], dim=-1)
    return objective, {"input_ids": TOKENS[None], "features": features[None],
                       "learn": torch.ones(1, len(TOKENS), dtype=torch.bool)}


def test_the_three_terms_match_a_hand_computation():
    objective, _ = _objective(DSparkConfig(block_size=2, markov_rank=0, ce_weight=0.3,
                                           l1_weight=0.7, confidence_weight=2.0))
    logits = torch.tensor([[[[2.0, 0.0, -1.0]]]])  # (B, A, D, V') = (1, 1, 1, 3)
    p = torch.tensor([[[[0.2, 0.7, 0.1]]]])
    hidden = torch.zeros(1, 1, 1, 64)
    hidden[..., 0] = 1.0
    with torch.no_grad():
        objective.draft.confidence.weight.zero_()
        objective.draft.confidence.weight[0, 0] = 0.5  # confidence logit 0.5
    per_row, accept = objective.row_terms(hidden, torch.zeros(1, 1, 1, dtype=torch.long),
                                          logits, p)
    q = torch.tensor([2.0, 0.0, -1.0]).softmax(-1)
    l1 = float((q - p[0, 0, 0]).abs().sum())
    ce = -float(q[1].log())  # the target's most likely token is 1
    label = 1 - l1 / 2
    sigma = 1 / (1 + torch.exp(torch.tensor(-0.5)))
    bce = -float(label * sigma.log() + (1 - label) * (1 - sigma).log())
    assert float(accept) == pytest.approx(label, abs=1e-6)
    assert float(per_row.detach()) == pytest.approx(0.3 * ce + 0.7 * l1 + 2.0 * bce, abs=1e-5)
    # the acceptance label is min(p, q) summed, the analytic acceptance
    assert label == pytest.approx(float(torch.minimum(q, p[0, 0, 0]).sum()), abs=1e-6)


def test_the_confidence_term_teaches_the_head_not_the_draft():
    objective, batch = _objective(DSparkConfig(block_size=4, markov_rank=8, ce_weight=0.0,
                                               l1_weight=1e-12, confidence_weight=1.0))
    loss, _ = objective(**batch)
    loss.backward()
    draft = objective.draft
    assert draft.confidence.weight.grad.abs().sum() > 0
    # only the (vanishing) L1 term reaches the logits: the label is detached
    assert draft.lm_head.weight.grad.abs().max() < 1e-6


def test_the_markov_head_reads_the_token_before_each_position():
    starts = torch.tensor([[0, 3, 11]])
    previous = teacher_previous(TOKENS[None], starts, 3)
    assert previous[0].tolist() == [[40, 41, 42], [43, 40, 41], [43, 7, 9]]
    objective, batch = _objective()
    valid = torch.ones(1, 3, dtype=torch.bool)
    args = (batch["input_ids"], batch["features"], starts, valid)
    with torch.no_grad():
        teacher = objective.block_logits(*args)
        given = objective.block_logits(*args, previous=previous)
        other = objective.block_logits(*args, previous=torch.zeros_like(previous))
    assert torch.equal(teacher, given) and not torch.allclose(teacher, other)


def test_the_training_forward_is_what_the_drafter_computes_when_decoding():
    objective, batch = _objective()
    draft = objective.draft.eval()
    starts, valid = torch.tensor([[1, 6, 10]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        logits = objective.block_logits(batch["input_ids"], batch["features"], starts, valid)
    for j, anchor in enumerate(starts[0].tolist()):
        drafter = DSparkDrafter(draft, TreeTopology.chain(3))
        context = batch["features"][:, :anchor, :objective.input_width]
        drafter._context = draft.context(context, torch.arange(anchor)[None])
        with torch.no_grad():
            _, base = drafter.outputs(int(TOKENS[anchor]), anchor)
            rows = MarkovRows(draft, base)
            decoded = rows.draft_logits([0, 1, 2], TOKENS[anchor:anchor + 3].tolist())
        torch.testing.assert_close(logits[0, j], decoded, atol=1e-4, rtol=1e-3)


def test_training_steps_lower_the_loss(descend):
    objective, batch = _objective()
    losses, counts = descend(objective, objective.draft, batch, 8)
    assert counts.shape == (3, 4)
    assert losses[-1] < losses[0]


def test_a_smoke_run_reports_acceptance_per_position(train_cfg):
    results = run_training(train_cfg("drafter=dspark"))
    accuracy = results["accuracy"]
    assert len(accuracy["top1"]) == len(accuracy["alpha"]) == 3  # smoke: blocks of 4
    assert all(0 <= a <= 1 for a in accuracy["alpha"])
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]


def test_a_row_loss_is_refused(train_cfg):
    with pytest.raises(ValueError, match="optim.loss=lk: DSpark trains on its own objective"):
        run_training(train_cfg("drafter=dspark", "optim.loss=lk"))


def test_a_resumed_run_ends_in_the_uninterrupted_runs_state(train_cfg, resumes_exactly,
                                                            tmp_path):
    run_training(train_cfg("drafter=dspark", out="whole"))
    resumes_exactly(partial(train_cfg, "drafter=dspark"), tmp_path, "draft.safetensors")


def test_confidence_logits_need_the_head():
    objective, _ = _objective(DSparkConfig(block_size=4, markov_rank=8, confidence_head=False))
    assert objective.draft.confidence is None
    with pytest.raises(Exception, match="no confidence head"):
        objective.draft.confidence_logits(torch.zeros(64), torch.tensor(3))
    assert isinstance(objective.draft.markov_w1, nn.Embedding)


@pytest.mark.parametrize("drafter", ["dspark", "dflash", "eagle3", "eagle"])
def test_training_continues_from_a_trained_draft(train_cfg, tmp_path, drafter):
    from verify.runtime.files import load_tensors

    run_training(train_cfg(f"drafter={drafter}", out="first"))
    trained = tmp_path / "first" / "checkpoint"
    # a learning rate of zero: the continued run must end where the trained draft was
    run_training(train_cfg(f"drafter={drafter}", f"drafter.checkpoint={trained}",
                           "optim.lr=0.0", out="second"))
    before = load_tensors(trained / "draft.safetensors")
    after = load_tensors(tmp_path / "second" / "checkpoint" / "draft.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    # the control: a fresh run of the same settings ends elsewhere
    run_training(train_cfg(f"drafter={drafter}", "optim.lr=0.0", "seed=1", out="fresh"))
    fresh = load_tensors(tmp_path / "fresh" / "checkpoint" / "draft.safetensors")
    assert not all(torch.equal(before[name], fresh[name]) for name in before
                   if name != "vocab_ids")


def test_a_dspark_draft_takes_the_opd_stage(train_cfg, tmp_path):
    import json

    from verify.runtime.files import load_tensors

    run_training(train_cfg("drafter=dspark", out="sft"))
    trained = tmp_path / "sft" / "checkpoint"
    results = run_training(train_cfg("drafter=dspark", "stage=opd",
                                     f"drafter.checkpoint={trained}", "opd.prompts_per_step=2",
                                     "opd.max_new_tokens=8", out="opd"))
    before = load_tensors(trained / "draft.safetensors")
    after = load_tensors(tmp_path / "opd" / "checkpoint" / "draft.safetensors")
    assert before.keys() == after.keys()
    # the Markov head learns from the draft's own proposals
    assert not torch.equal(before["markov_w2.weight"], after["markov_w2.weight"])
    written = json.loads((tmp_path / "opd" / "eval.json").read_text())
    assert written["stage"] == "opd" and written["rollouts"]["steps"] > 0
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
