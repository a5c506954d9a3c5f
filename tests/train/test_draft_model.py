"""Distilling a draft model on tiny targets: the divergences by hand, the student before
training, loss-lowering steps, and the recipe end to end (a Hugging Face folder that reloads,
a reduced vocabulary that is all it proposes, exact greedy and sampled decoding, resuming)."""

import json
import math
import re
import shutil
from functools import partial

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from drafters import build_drafter
from drafters.draft_model import (
    DraftModelConfig,
    DraftModelDrafter,
    draft_model_config,
    load_draft_model,
    read_vocab,
    save_draft_model,
    truncated_copy,
)
from experiments.common import CONF_DIR
from tests.drafters.test_draft_vocab_sampling import check_exact_sampling, tiny_correctness_target
from train import run_training
from train.draft_model import DistillLoss, divergence, initial_draft
from verify.loop import generate
from verify.runtime.model import Target, hf_generate, load_target

TOKENS = torch.tensor([40, 41, 42, 43, 40, 41, 42, 44, 40, 41, 42, 43, 7, 9])


def conf(group, name):
    return OmegaConf.load(f"{CONF_DIR}/{group}/{name}.yaml")


def _cfg(tmp_path, *overrides, out="run"):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("train", ["experiment=draft_model_smoke", f"out_dir={tmp_path / out}",
                                 f"data.cache_dir={tmp_path / 'cache'}", *overrides])


# -- the divergences ------------------------------------------------------------------------------

def test_divergences_by_hand():
    p, q = torch.tensor([0.0, math.log(3)]), torch.tensor([0.0, 0.0])  # (.25, .75), (.5, .5)
    forward = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    reverse = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert divergence(p, q, "forward_kl").item() == pytest.approx(forward, abs=1e-6)
    assert divergence(p, q, "reverse_kl").item() == pytest.approx(reverse, abs=1e-6)
    assert divergence(p, q, "tv").item() == pytest.approx(0.25, abs=1e-6)
    for kind in ("forward_kl", "reverse_kl", "tv"):
        assert divergence(p, p, kind).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="divergence must be one of"):
        divergence(p, q, "kl")


# -- the student ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_the_truncated_student_starts_as_the_self_draft_on_its_own_tensors(arch):
    target = load_target(tiny=arch)
    vocab = torch.arange(0, 256, 3)
    student = initial_draft(target.model, DraftModelConfig(num_layers=1), vocab).eval()
    with torch.no_grad():  # eval(): GPT-2 has dropout
        expected = truncated_copy(target.model, 1)(TOKENS[None]).logits[0][:, vocab]
        got = student(TOKENS[None]).logits[0]
    torch.testing.assert_close(got, expected)
    targets = {p.data_ptr() for p in target.model.parameters()}
    assert not any(p.data_ptr() in targets for p in student.parameters())
    assert not student.get_input_embeddings().weight.requires_grad  # looked up, never learnt
    assert student.get_output_embeddings().weight.requires_grad
    assert not student.config.tie_word_embeddings


def test_a_fresh_student_takes_the_architecture_given():
    target = load_target(tiny="llama")
    config = DraftModelConfig(num_layers=1, init="fresh", architecture={
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1})
    student = initial_draft(target.model, config, None)
    assert student.config.hidden_size == 32 and student.config.head_dim == 16
    assert student(TOKENS[None]).logits.shape == (1, len(TOKENS), 256)
    assert student.get_input_embeddings().weight.requires_grad  # another width: it learns


@pytest.mark.parametrize("config, message", [
    (DraftModelConfig(init="copy"), "init must be one of"),
    (DraftModelConfig(num_layers=1, init="fresh", architecture={"hidden": 8}), "not in the"),
    (DraftModelConfig(num_layers=1, architecture={"hidden_size": 8}), "init=fresh only"),
])
def test_bad_student_settings_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        initial_draft(load_target(tiny="llama").model, config, None)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "tv"])
def test_distillation_steps_lower_the_divergence_and_leave_the_target_alone(kind, descend):
    target = load_target(tiny="llama")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    vocab = torch.arange(128)
    student = initial_draft(target.model, DraftModelConfig(num_layers=1), vocab)
    objective = DistillLoss(student, target.model.get_output_embeddings(), vocab, kind)
    input_ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = target.model.base_model(input_ids).last_hidden_state
    batch = {"input_ids": input_ids, "features": features,
             "learn": torch.ones_like(input_ids, dtype=torch.bool)}
    losses, counts = descend(objective, student, batch, 15, torch.optim.Adam)
    assert counts.shape == (1, 3) and counts[0, 0] == 4 * 23
    assert losses[-1] < 0.7 * losses[0], losses
    after = target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- the recipe end to end ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke-sized distilled draft (reduced vocabulary) and its run folder."""
    tmp_path = tmp_path_factory.mktemp("draft_model")
    results = run_training(_cfg(tmp_path))
    return tmp_path / "run", results


def test_the_run_reports_its_folder_and_how_to_use_it(trained):
    run, results = trained
    assert results["use"] == f"drafter.path={run / 'checkpoint'}"
    saved = json.loads((run / "eval.json").read_text())
    assert saved["decoding"]["identical"] == saved["decoding"]["prompts"] == 2
    assert 0 <= saved["accuracy"]["top1"][0] <= saved["accuracy"]["top5"][0] <= 1
    # a reduced vocabulary covers part of the held-out answers, and caps top-1 there
    assert saved["accuracy"]["top1"][0] <= saved["accuracy"]["vocab_coverage"] < 1
    assert saved["decoding"]["draft_ms_per_forward"] > 0
    # the training speed of the run, as experiments.scale_speed reads it
    training = saved["training"]
    assert training["steps"] == saved["config"]["optim"]["max_steps"] and training["ranks"] == 1
    assert training["tokens_per_s"] > 0 and training["seconds"] > 0


def test_the_saved_folder_loads_as_a_plain_hugging_face_model(trained):
    run, _ = trained
    folder = run / "checkpoint"
    vocab = read_vocab(folder)
    assert vocab is not None and 64 < len(vocab) <= 128  # the smoke data's most written
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 1
    full = model.get_output_embeddings().weight  # (V, H): the draft's rows at vocab_ids
    target_head = load_target(tiny="llama").model.get_output_embeddings().weight
    outside = torch.ones(256, dtype=torch.bool)
    outside[vocab] = False
    torch.testing.assert_close(full[outside], target_head[outside])  # the target's own rows
    assert not torch.equal(full[vocab], target_head[vocab])  # trained


@pytest.mark.parametrize("tree", ["chain4", "tree16", "eagle2"])
def test_a_distilled_draft_proposes_its_vocabulary_only_and_decodes_exactly(trained, tree):
    run, _ = trained
    target = load_target(tiny="llama")
    cfg = {**conf("drafter", "draft_model"), "path": str(run / "checkpoint")}
    drafter = build_drafter(cfg, conf("tree", tree), target)
    assert isinstance(drafter, DraftModelDrafter)
    assert torch.equal(drafter.vocab_ids, read_vocab(run / "checkpoint"))
    proposed = []
    propose = drafter.propose_batch  # the loop drafts through it, also for one sequence
    drafter.propose_batch = lambda ctxs: proposed.extend(propose(ctxs)) or proposed[-len(ctxs):]
    result = generate(target.model, TOKENS, 40, drafter=drafter)
    assert torch.equal(result.tokens, generate(target.model, TOKENS, 40).tokens)
    drafted = torch.cat([t.tokens[1:] for t in proposed])
    assert len(drafted) > 0 and torch.isin(drafted, drafter.vocab_ids).all()


def test_a_loaded_draft_shares_the_targets_token_table(trained):
    # trained with the target's frozen table: loaded beside the target, one copy in memory
    run, _ = trained
    target = load_target(tiny="llama")
    model, _ = load_draft_model(run / "checkpoint", target)
    table = target.model.get_input_embeddings().weight
    assert model.get_input_embeddings().weight.data_ptr() == table.data_ptr()
    other = load_target(tiny="llama", seed=1)  # the same name, other weights: refused ...
    with pytest.raises(ValueError, match="draft model in .* trained on 'tiny-llama'"):
        load_draft_model(run / "checkpoint", other)
    # ... unless the user says so; another table: the draft keeps its own
    model, _ = load_draft_model(run / "checkpoint", other, allow_other_target=True)
    assert model.get_input_embeddings().weight.data_ptr() != other.model.get_input_embeddings(
    ).weight.data_ptr()


def test_a_distilled_draft_with_weights_missing_is_refused_by_name(trained, tmp_path):
    folder = tmp_path / "draft"
    shutil.copytree(trained[0] / "checkpoint", folder)
    state = load_file(str(folder / "model.safetensors"))
    dropped = next(key for key in state if "layers.0" in key)
    del state[dropped]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"does not hold its weights whole \(missing: .*"
                                         rf"{re.escape(dropped.split('.', 1)[1])}"):
        load_draft_model(folder, load_target(tiny="llama"))


def test_a_full_vocabulary_draft_assists_hugging_face_generate(tmp_path):
    results = run_training(_cfg(tmp_path, "drafter.draft_vocab_size=null"))
    folder = tmp_path / "run" / "checkpoint"
    assert read_vocab(folder) is None and results["decoding"]["identical"] == 2
    assert results["accuracy"]["vocab_coverage"] == 1.0
    target = load_target(tiny="llama")
    assistant = AutoModelForCausalLM.from_pretrained(folder)
    assisted = hf_generate(target, TOKENS, 24, assistant_model=assistant)
    assert torch.equal(assisted, hf_generate(target, TOKENS, 24))


def test_a_resumed_run_ends_in_the_uninterrupted_runs_state(tmp_path, resumes_exactly):
    run_training(_cfg(tmp_path, out="whole"))
    resumes_exactly(partial(_cfg, tmp_path), tmp_path, "model.safetensors")


def test_resuming_refuses_another_student_or_another_target(tmp_path):
    run_training(_cfg(tmp_path, "optim.max_steps=2"))
    with pytest.raises(ValueError, match="divergence: saved forward_kl, asked tv"):
        run_training(_cfg(tmp_path, "drafter.divergence=tv"))
    with pytest.raises(ValueError, match="belongs to 'tiny-llama', not 'tiny-qwen2'"):
        run_training(_cfg(tmp_path, "target=tiny_qwen2"))
    with pytest.raises(ValueError, match="leave drafter.path null"):
        run_training(_cfg(tmp_path, "drafter.path=/somewhere"))


# -- sampling stays exact -------------------------------------------------------------------------

# The static tree is slow (make test-all): the dynamic tree's case runs the same reduced-vocabulary
# sampling rule in CI, and the CI suite's time is spent.
@pytest.mark.parametrize("tree", [pytest.param("tree8", marks=pytest.mark.slow), "eagle2"])
def test_sampling_with_a_reduced_vocabulary_draft_is_exact(tmp_path, tree):
    # The correctness evaluation's tiny target (vocabulary 8) and its chi-square test, with a
    # saved draft that can propose 5 of the 8 tokens: sampled children (tree8, q recorded) or
    # top-k ones (eagle2). (experiments.correctness itself drafts with a self-draft there.)
    dist, model = tiny_correctness_target()
    small = Target(model, None, "tiny")
    vocab = torch.tensor([0, 1, 2, 3, 6])
    save_draft_model(initial_draft(model, DraftModelConfig(num_layers=1), vocab), vocab,
                     tmp_path, small, {})
    drafter = build_drafter({"name": "draft_model", "path": str(tmp_path)}, conf("tree", tree),
                            small)
    assert torch.equal(drafter.vocab_ids, vocab)
    check_exact_sampling(model, drafter, dist)


def test_targets_computed_live_train_the_draft_the_cached_ones_do(tmp_path):
    run_training(_cfg(tmp_path, out="cached"))
    run_training(_cfg(tmp_path, "data.cache_hidden=false", out="live"))
    cached, live = (load_file(str(tmp_path / name / "checkpoint/model.safetensors"))
                    for name in ("cached", "live"))
    assert cached.keys() == live.keys()
    for key in cached:  # float16 features either way; only padding widths differ
        torch.testing.assert_close(live[key], cached[key], atol=1e-4, rtol=1e-3)
    vocab = read_vocab(tmp_path / "cached/checkpoint")
    fresh = initial_draft(load_target(tiny="llama").model, DraftModelConfig(num_layers=1), vocab)
    # the runs did train: the head moved away from the target's rows
    assert not torch.allclose(fresh.state_dict()["lm_head.weight"],
                              cached["lm_head.weight"][vocab])


def test_a_fresh_architecture_is_given_on_the_command_line(tmp_path):
    cfg = _cfg(tmp_path, "drafter.init=fresh",
               "drafter.architecture={hidden_size: 32, num_attention_heads: 2}")
    config = draft_model_config(cfg.drafter)
    assert config.architecture == {"hidden_size": 32, "num_attention_heads": 2}
    student = initial_draft(load_target(tiny="llama").model, config, None)
    assert student.config.hidden_size == 32 and student.config.num_hidden_layers == 1
