"""The Medusa recipe end to end on a tiny target: training lowers the loss, an interrupted run
resumes to the uninterrupted run's exact state, checkpoints refuse the wrong target or heads,
and Medusa-2's adapter and heads load back together into a lossless drafter."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import train.features as features_module
import train.recipes.medusa as recipe
from drafters import build_drafter
from drafters.medusa import medusa_config
from experiments.common import CONF_DIR
from experiments.tree_search import load_accuracies
from tests.train.test_feature_set import write_feature_set
from train import run_training
from train.distributed import DistEnv
from train.features import FeatureSet, SequenceFeatures, answer_sequences, extract_features
from train.medusa import HeadLoss, cached_rows, feature_rows
from verify.loop import generate
from verify.runtime.features import num_layers
from verify.runtime.model import load_target_from_config

ROOT = Path(__file__).resolve().parents[2]
SINGLE = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))


def _heads_state(out_dir):
    return load_file(str(out_dir / "checkpoint" / "heads.safetensors"))


def test_two_training_steps_lower_the_heads_loss(train_cfg):
    cfg = train_cfg("optim.max_steps=2", "optim.lr=0.01")
    target = load_target_from_config(cfg.target)
    train_set, _ = recipe.distilled_data(cfg.data, target, SINGLE)
    hidden, targets = cached_rows(train_set, 2)
    fresh = recipe.MedusaHeads(target.model.get_output_embeddings(), 2, 1)
    run_training(cfg)
    trained = recipe.MedusaHeads(target.model.get_output_embeddings(), 2, 1)
    trained.load_state_dict(_heads_state(Path(cfg.out_dir)))
    with torch.no_grad():
        before, _ = HeadLoss(fresh, 0.8)(hidden.float(), targets)
        after, _ = HeadLoss(trained, 0.8)(hidden.float(), targets)
    assert after < before - 0.1


def test_a_resumed_run_ends_in_the_uninterrupted_runs_state(train_cfg, interrupt, tmp_path):
    run_training(train_cfg(out="whole"))
    resume = interrupt(recipe, 3)  # after the checkpoint of step 2
    with pytest.raises(KeyboardInterrupt):
        run_training(train_cfg(out="cut"))
    assert json.loads((tmp_path / "cut/checkpoint/config.json").read_text())["num_heads"] == 2
    assert torch.load(tmp_path / "cut/checkpoint/train_state.pt")["step"] == 2
    resume()
    run_training(train_cfg(out="cut"))
    whole, resumed = _heads_state(tmp_path / "whole"), _heads_state(tmp_path / "cut")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    optimizer = [torch.load(tmp_path / f"{run}/checkpoint/train_state.pt")["optimizer"]
                 for run in ("whole", "cut")]
    moments = [o["state"][0]["exp_avg"] for o in optimizer]
    assert torch.equal(*moments)


def test_resuming_refuses_other_heads_or_another_target(train_cfg):
    run_training(train_cfg())
    with pytest.raises(ValueError, match="num_heads: saved 2, asked 3"):
        run_training(train_cfg("drafter.num_heads=3"))
    with pytest.raises(ValueError, match="belongs to 'tiny-llama', not 'tiny-qwen2'"):
        run_training(train_cfg("target=tiny_qwen2"))


def test_resuming_refuses_other_training_settings_naming_them_and_the_ways_out(train_cfg):
    run_training(train_cfg())
    with pytest.raises(ValueError) as refused:
        run_training(train_cfg("seed=1", "optim.lr=0.5", "data.num_prompts=8"))
    message = str(refused.value)
    for named in ("seed: saved 0, asked 1", "optim.lr: saved ", "asked 0.5",
                  "data.num_prompts: saved 16, asked 8", "another out_dir", "resume=false"):
        assert named in message
    assert "save_every" not in message
    # how often it saves and logs, and the final evaluation, change nothing trained: resumed
    run_training(train_cfg("save_every=3", "logger.log_every=1", "eval.num_prompts=1"))


def test_a_truncated_checkpoint_file_is_named(train_cfg, tmp_path):
    run_training(train_cfg())
    for name in ("heads.safetensors", "train_state.pt"):
        path = tmp_path / "run" / "checkpoint" / name
        whole = path.read_bytes()
        path.write_bytes(whole[:len(whole) // 2])
        with pytest.raises(ValueError, match=rf"{name} cannot be read"):
            run_training(train_cfg())
        path.write_bytes(whole)


@pytest.mark.parametrize("override, message", [
    ("save_every=0", "save_every must be at least 1, got 0"),
    ("optim.max_steps=0", "optim.max_steps must be at least 1, got 0"),
    ("dist.strategy=zero3", r"dist.strategy must be one of \('ddp', 'fsdp'\), got 'zero3'"),
])
def test_settings_a_run_cannot_mean_are_refused_by_name(train_cfg, override, message):
    with pytest.raises(ValueError, match=message):
        run_training(train_cfg(override))


@pytest.mark.parametrize("overrides, message", [
    (["drafter=dflash", "drafter.loss_decay=0"], "drafter.loss_decay must be > 0"),
    (["drafter=pard", "eval.chain=99"], "eval.chain=99 is deeper than a block"),
    (["drafter=draft_model", "drafter.path=/some/model"], "drafter.path names a draft"),
    (["drafter=medusa", "drafter.variant=medusa2", "data.sharegpt_tokens=64"],
     "data.sharegpt_tokens trains Medusa-1"),
])
def test_a_recipes_refusal_leaves_no_out_dir(train_cfg, tmp_path, overrides, message):
    """Each recipe refused these once it ran, inside the out_dir lock: an empty out_dir
    stayed behind (Medusa's after distilling its answers)."""
    with pytest.raises(ValueError, match=message):
        run_training(train_cfg(*overrides))
    assert not (tmp_path / "run").exists()


def test_medusa2_adapter_and_heads_load_together_and_stay_lossless(train_cfg, tmp_path):
    stage1 = run_training(train_cfg(out="stage1"))["checkpoint"]
    with pytest.raises(ValueError, match="init_heads"):
        run_training(train_cfg("drafter.variant=medusa2", f"drafter.init_heads={stage1}",
                               "drafter.num_heads=3"))
    cfg = train_cfg("drafter.variant=medusa2", f"drafter.init_heads={stage1}",
                    "optim.max_steps=2", "optim.base_lr=0.05")
    results = run_training(cfg)
    checkpoint = tmp_path / "run" / "checkpoint"
    assert (checkpoint / "adapter" / "adapter_config.json").is_file()
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
    plain = load_target_from_config(cfg.target)
    with pytest.raises(ValueError, match="target.adapter="):
        build_drafter({**cfg.drafter, "checkpoint": str(checkpoint)}, {"name": "c",
                      "choices": [[0], [0, 0]]}, plain)
    merged = load_target_from_config({**cfg.target, "adapter": str(checkpoint / "adapter")})
    changed = any(not torch.equal(a, b) for a, b in zip(plain.model.parameters(),
                                                         merged.model.parameters()))
    assert changed  # the adapter learned something, so "lossless" below is not trivial
    drafter = build_drafter({**cfg.drafter, "checkpoint": str(checkpoint)},
                            {"name": "c", "choices": [[0], [1], [0, 0]]}, merged)
    prompt = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44])
    plain_tokens = generate(merged.model, prompt, 24).tokens
    assert torch.equal(generate(merged.model, prompt, 24, drafter=drafter).tokens, plain_tokens)


def test_the_run_reports_where_things_went_and_tree_search_reads_its_table(train_cfg, capsys):
    results = run_training(train_cfg())
    out = capsys.readouterr().out
    assert f"drafter.checkpoint={results['checkpoint']}" in out and "tau" in out
    assert "| 1 | token +3 |" in out  # one accuracy row per head
    table = load_accuracies(results["eval"])
    assert table == results["accuracy"]["rank_accuracy"] and len(table) == 2
    # the heads' draft vocabulary: the share of held-out answer tokens it can propose
    assert 0 < results["accuracy"]["vocab_coverage"] <= 1


def test_the_command_line_entry_names_runs_by_their_overrides(tmp_path):
    # As a user runs it, from another folder: the run lands under results/ there, in a folder
    # named by the overrides that can be handed back as an override value unquoted (not by
    # dist.strategy: how ranks share the work; one process trains unwrapped under fsdp too).
    command = [sys.executable, str(ROOT / "train.py"), "experiment=smoke", "drafter.num_heads=3",
               "dist.strategy=fsdp", f"data.cache_dir={tmp_path / 'cache'}",
               "hydra.run.dir=hydra"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "results/train/tiny-llama/medusa/drafter.num_heads-3+experiment-smoke"
    assert (run / "checkpoint" / "heads.safetensors").is_file()
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("bench", ["drafter=medusa", f"drafter.checkpoint={run}/checkpoint"])
    assert cfg.drafter.checkpoint == f"{run}/checkpoint"


def test_prefilled_states_give_the_distilled_answers_own_medusa_rows(train_cfg, tmp_path):
    # The ShareGPT path (prefill) and the distilled path (states kept while answering) must
    # hand the heads the same rows: same targets, states equal up to float16.
    cfg = train_cfg()
    target = load_target_from_config(cfg.target)
    answers, _ = recipe.distilled_data(cfg.data, target, SINGLE)
    hidden, targets = cached_rows(answers, 3)
    last = num_layers(target.model.config)
    prefilled = extract_features(target, answer_sequences(answers), (last,), tmp_path / "f")
    rows, row_targets = feature_rows(prefilled, 3)
    assert torch.equal(row_targets, targets)
    torch.testing.assert_close(rows.float(), hidden.float(), atol=5e-3, rtol=1e-2)
    # the answers are the target's greedy tokens: labelled by the target, nearly all agree
    # (an off-by-one would agree by chance only)
    _, labelled = feature_rows(prefilled, 3, target.model.get_output_embeddings())
    known = targets >= 0
    assert torch.equal(labelled >= 0, known)
    assert (labelled[known] == targets[known]).float().mean() > 0.95


def test_feature_rows_learn_assistant_tokens_only(tmp_path):
    # tokens 10..16; turns: user (10, 11), assistant (12, 13), user (14), assistant (15, 16)
    ids = torch.arange(10, 17)
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    states = torch.arange(7, dtype=torch.float16)[:, None].expand(7, 4)
    features = write_feature_set(tmp_path, [SequenceFeatures(ids, mask, states)], (2,))
    hidden, targets = feature_rows(features, 2)
    assert hidden[:, 0].tolist() == [1, 2, 4, 5]  # the states that predicted 12, 13, 15, 16
    assert targets.tolist() == [[13, -1], [-1, 15], [16, -1], [-1, -1]]
    with pytest.raises(ValueError, match="one state per token"):
        feature_rows(FeatureSet(features.entries, (1, 2), tmp_path), 2)
    # labelled by a target whose greedy token after a state of value j is 100 + j
    _, labelled = feature_rows(features, 2, ArgmaxIs100PlusState())
    assert labelled.tolist() == [[102, -1], [-1, 104], [105, -1], [-1, -1]]
    with pytest.raises(ValueError, match="drafter.labels must be target or text"):
        medusa_config({"labels": "gold"})


class ArgmaxIs100PlusState(torch.nn.Module):
    """A stand-in LM head: logits peaking at 100 + the state's first value."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, states):
        logits = torch.zeros(len(states), 200)
        logits[torch.arange(len(states)), 100 + states[:, 0].long()] = 1.0
        return logits


def test_medusa1_trains_on_prefilled_conversations(train_cfg, monkeypatch):
    # Conversations stand in for ShareGPT (tiny targets have no chat template); user turns
    # teach nothing, and the draft vocabulary comes from the sequences.
    generator = torch.Generator().manual_seed(0)
    conversations = [(torch.randint(3, 200, (40,), generator=generator),
                      torch.arange(40) % 10 >= 4) for _ in range(12)]
    asked = []

    def fake_sharegpt(tokenizer, max_tokens, total, seed=None, path=None):
        asked.append(total)
        return iter(conversations)
    monkeypatch.setattr(features_module, "sharegpt_sequences", fake_sharegpt)
    cfg = train_cfg("data.sharegpt_tokens=480", "data.num_prompts=0", "optim.max_steps=6",
                    "optim.lr=0.01", "drafter.draft_vocab_size=64")
    results = run_training(cfg)
    assert asked == [480]
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
    heads = recipe.load_heads(results["checkpoint"], load_target_from_config(cfg.target))
    seen = torch.cat([ids for ids, _ in conversations]).unique()
    assert set(heads.draft_index().ge(0).nonzero().squeeze(1).tolist()) <= set(seen.tolist())
    with pytest.raises(ValueError, match="Medusa-2"):
        run_training(train_cfg("data.sharegpt_tokens=480", "drafter.variant=medusa2",
                               out="medusa2"))
