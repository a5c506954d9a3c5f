"""EAGLE training on tiny targets: the training-time test unrolls exactly what decoding runs,
the loss goes down, an interrupted run resumes to the same state, checkpoints refuse another
target, and a trained draft gets drafts accepted while decoding stays exact."""

import json
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

from drafters import build_drafter
from drafters.eagle import EagleConfig, EagleDraft, EagleDrafter, default_layout
from drafters.engine import LevelRequest
from train import run_training
from train.distill import distilled_data
from train.distributed import DistEnv
from train.eagle import EagleLoss, ttt_mask
from train.features import LiveFeatures, training_features
from verify.loop import generate
from verify.protocol import DraftContext
from verify.runtime.features import eagle3_layers
from verify.runtime.model import load_target, load_target_from_config
from verify.sampling import SamplingParams
from verify.tree import TreeTopology

TOKENS = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 7, 9])


def _features(target, tokens, layers):
    with torch.no_grad():
        states = target.model(tokens[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


def _eagle_cfg(tmp_path, *overrides, out="run"):
    from hydra import compose, initialize_config_dir

    from experiments.common import CONF_DIR
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("train", ["experiment=eagle_smoke", f"out_dir={tmp_path / out}",
                                 f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def test_the_ttt_mask_lets_a_row_see_its_chain_only():
    allowed = ttt_mask(5, 2, torch.float32, torch.device("cpu"))[0, 0] == 0  # (5, 15)
    # row 4 at step 2: real entries 0..2, its step-1 entry (row 3) and itself (step 2, row 4)
    assert allowed[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert allowed[2].nonzero().flatten().tolist() == [0, 5 + 1, 10 + 2]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_unrolled_steps_equal_drafting_the_chain(arch, variant):
    # step s, row j of the training-time test is the depth-s node of the chain rooted at real
    # entry j - s, exactly as the drafter computes it at decoding time (tree mask, positions)
    target = load_target(tiny=arch)
    layers = (-1,) if variant == "eagle1" else eagle3_layers(2)
    draft = EagleDraft(target.model, layers, layout=default_layout(variant)).eval()
    objective = EagleLoss(draft, target.model.get_output_embeddings(), EagleConfig(noise=0.0))
    features = _features(target, TOKENS, draft.feature_layers)
    inputs = draft.fuse_features(features[None, :-1])
    with torch.no_grad():
        unrolled = list(objective.unroll(inputs, TOKENS[None, 1:], steps=4))
    drafter = EagleDrafter(draft, TreeTopology.chain(1))
    for step, j in [(0, 5), (1, 6), (3, 9), (2, 12)]:
        root = j - step
        ctx = DraftContext(TOKENS[:root + 2], features[:root + 1], SamplingParams())
        with torch.no_grad():
            hidden = drafter._catch_up([ctx])[0][0]
            for depth in range(1, step + 1):
                token = int(TOKENS[root + 1 + depth])
                request = LevelRequest([list(range(depth + 1))], [token], hidden[None])
                hidden = drafter._forward_level({0: request})[0][0][0]
        drafter.engine.reset()
        # float rounding differs between the two shapes of forward; a wrong mask is off by O(1)
        torch.testing.assert_close(unrolled[step][0, j], hidden, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_training_steps_lower_the_loss(arch, variant, descend):
    torch.manual_seed(0)
    target = load_target(tiny=arch)
    layers = (-1,) if variant == "eagle1" else eagle3_layers(2)
    draft = EagleDraft(target.model, layers, train_lm_head=variant == "eagle3",
                       layout=default_layout(variant))
    config = EagleConfig(variant=variant, ttt_steps=1 if variant == "eagle1" else 3, noise=0.0)
    objective = EagleLoss(draft, target.model.get_output_embeddings(), config)
    stored = layers if variant == "eagle1" else (*draft.feature_layers, 2)
    batch = {"input_ids": TOKENS[None], "features": _features(target, TOKENS, stored)[None],
             "learn": torch.ones(1, len(TOKENS), dtype=torch.bool)}
    losses, counts = descend(objective, draft, batch, 8)
    assert counts.shape == (config.ttt_steps, 4)
    assert losses[-1] < losses[0] * 0.8, losses


def test_a_resumed_run_ends_in_the_uninterrupted_runs_state(tmp_path, resumes_exactly):
    run_training(_eagle_cfg(tmp_path, out="whole"))
    resumes_exactly(partial(_eagle_cfg, tmp_path), tmp_path, "draft.safetensors")


def test_resuming_refuses_another_draft_or_another_target(tmp_path):
    run_training(_eagle_cfg(tmp_path))
    config = json.loads((tmp_path / "run/checkpoint/config.json").read_text())
    assert config["target"]["name"] == "tiny-llama"
    with pytest.raises(ValueError, match=r"draft_vocab_size: saved \d+, asked 64"):
        run_training(_eagle_cfg(tmp_path, "drafter.draft_vocab_size=64"))
    with pytest.raises(ValueError, match="belongs to 'tiny-llama', not 'tiny-qwen2'"):
        run_training(_eagle_cfg(tmp_path, "target=tiny_qwen2"))


@pytest.mark.parametrize("drafter", ["eagle", "eagle3"])
def test_a_trained_draft_is_accepted_and_decoding_stays_exact(tmp_path, drafter):
    # A tiny random target's answers cannot be generalised from 16 prompts, but they can be
    # learnt: on its training prompts a trained draft must get drafts accepted. Any misaligned
    # feature, token or vocabulary map between training and decoding would show here.
    cfg = _eagle_cfg(tmp_path, f"drafter={drafter}", "optim.max_steps=200", "optim.lr=0.003",
                     "optim.warmup_steps=10", "save_every=1000")
    results = run_training(cfg)
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
    # the figures a vocabulary-size sweep trades: what the draft can propose, what it costs
    assert 0.5 < results["accuracy"]["vocab_coverage"] <= 1.0
    assert results["decoding"]["draft_ms_per_forward"] > 0
    target = load_target(tiny="llama")
    answers, _ = distilled_data(cfg.data, target, DistEnv(0, 1, torch.device("cpu")))
    tree = {"depth": 3, "top_k": 3, "total_tokens": 6}
    trained = build_drafter({**cfg.drafter, "checkpoint": results["checkpoint"]}, tree, target)
    taus = []
    for answer in answers[:6]:
        plain = generate(target.model, answer.prompt, 16).tokens
        result = generate(target.model, answer.prompt, 16, drafter=trained)
        assert torch.equal(result.tokens, plain)
        taus.append(result.tau)
    assert sum(taus) / len(taus) > 1.8, taus


def test_live_features_are_the_cached_ones_and_a_live_run_trains(tmp_path):
    cfg = _eagle_cfg(tmp_path)
    target = load_target_from_config(cfg.target)
    answers, heldout = distilled_data(cfg.data, target, DistEnv(0, 1, torch.device("cpu")))
    cached, _ = training_features(cfg.data, target, answers, heldout, (1, 2))
    live_data = OmegaConf.merge(cfg.data, {"cache_hidden": False})
    live, _ = training_features(live_data, target, answers, heldout, (1, 2))
    assert isinstance(live, LiveFeatures) and len(live) == len(cached) == 16
    for ours, theirs in zip(live.take([0, 3, 5]), cached.take([0, 3, 5])):
        assert torch.equal(ours.input_ids, theirs.input_ids)
        assert torch.equal(ours.loss_mask, theirs.loss_mask)
        torch.testing.assert_close(ours.features, theirs.features, atol=1e-2, rtol=1e-2)
    assert ([t.tolist() for t in live.learned_tokens()]
            == [t.tolist() for t in cached.learned_tokens()])
    results = run_training(_eagle_cfg(tmp_path, "data.cache_hidden=false", out="live"))
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
