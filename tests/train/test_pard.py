"""Training PARD on tiny targets: the layout's loss falls, the recipe end to end (a folder that
decodes exactly at its block size), resuming bit for bit, and refusing another target's run."""

import json
from functools import partial

import pytest
import torch
from hydra import compose, initialize_config_dir

from drafters.pard import PardConfig, read_mask
from experiments.common import CONF_DIR
from train import run_training
from train.pard import PardLoss, block_layout, initial_pard
from verify.runtime.model import load_target


def _cfg(tmp_path, *overrides, out="run"):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("train", ["experiment=pard_smoke", f"out_dir={tmp_path / out}",
                                 f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def test_pard_steps_lower_the_loss_at_every_offset_and_leave_the_target_alone(descend):
    target = load_target(tiny="llama")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    config = PardConfig(num_layers=1, block_size=3, draft_vocab_size=128)
    input_ids = torch.randint(0, 128, (4, 20), generator=torch.Generator().manual_seed(0))
    draft, vocab = initial_pard(target, config, iter([input_ids.flatten()]))
    objective = PardLoss(draft, target.model.get_output_embeddings(), vocab, "forward_kl")
    with torch.no_grad():
        features = target.model.base_model(input_ids).last_hidden_state
    batch = {"input_ids": input_ids, "features": features,
             "learn": torch.ones_like(input_ids, dtype=torch.bool)}
    losses, counts = descend(objective, draft, batch, 15, torch.optim.Adam)
    # rows per offset g: the tokens t + g + 1 < 20 of 4 sequences
    assert counts[:, 0].tolist() == [4 * 19, 4 * 18, 4 * 17]
    assert losses[-1] < 0.7 * losses[0], losses
    assert not torch.allclose(draft.mask_embedding, initial_pard(  # the mask trained
        target, config, iter([input_ids.flatten()]))[0].mask_embedding)
    after = target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_dropped_layout_trains_a_subset_of_the_full_ones_rows():
    target = load_target(tiny="llama")
    config = PardConfig(num_layers=1, block_size=4, draft_vocab_size=None)
    draft, vocab = initial_pard(target, config, iter([]))
    objective = PardLoss(draft, target.model.get_output_embeddings(), vocab, "tv")
    input_ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    features = target.model.base_model(input_ids).last_hidden_state.detach()
    learn = torch.ones_like(input_ids, dtype=torch.bool)
    layout = block_layout(30, 4, 0.5, 0.0, torch.Generator().manual_seed(0))
    _, full = objective(input_ids, features, learn)
    _, dropped = objective(input_ids, features, learn, *layout)
    assert dropped[0, 0] == full[0, 0] and (dropped[1:, 0] < full[1:, 0]).all()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pard")
    return tmp_path, run_training(_cfg(tmp_path))


def test_the_run_saves_a_pard_folder_that_decodes_exactly(trained):
    tmp_path, results = trained
    folder = tmp_path / "run" / "checkpoint"
    assert results["use"] == f"drafter.path={folder}"
    assert read_mask(folder)[0] == 4
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert saved["decoding"]["identical"] == saved["decoding"]["prompts"] == 2
    assert len(saved["accuracy"]["top1"]) == 4  # one row per depth of the block


def test_a_resumed_run_ends_in_the_uninterrupted_runs_state(trained, resumes_exactly):
    tmp_path, _ = trained
    resumes_exactly(partial(_cfg, tmp_path), tmp_path, "model.safetensors", whole="run")
    assert torch.equal(read_mask(tmp_path / "run/checkpoint")[1],
                       read_mask(tmp_path / "cut/checkpoint")[1])


def test_resuming_refuses_another_target_or_block(trained):
    tmp_path, _ = trained
    with pytest.raises(ValueError, match="belongs to 'tiny-llama', not 'tiny-qwen2'"):
        run_training(_cfg(tmp_path, "target=tiny_qwen2"))
    with pytest.raises(ValueError, match="block_size: saved 4, asked 3"):
        run_training(_cfg(tmp_path, "drafter.block_size=3"))


def test_a_run_adapts_an_existing_draft(trained, tmp_path):
    source = trained[0] / "run" / "checkpoint"
    results = run_training(_cfg(tmp_path, f"drafter.path={source}", "optim.max_steps=2"))
    assert results["decoding"]["identical"] == 2
    info = json.loads((tmp_path / "run/checkpoint/treedraft.json").read_text())
    assert info["start"] == str(source)
