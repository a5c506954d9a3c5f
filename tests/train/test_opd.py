"""Draft-OPD (stage=opd) on tiny targets: the loss against a hand computation (both KL
directions, the reject decay; a variant with the directions swapped or the decay shifted fails
it), gradients only where the loss reaches, rollouts recorded from the loop itself, the packed
target forward equal to separate forwards, the config and its refusals, and a tiny run after a
supervised one: trained, evaluated, its curve written, resumed to the uninterrupted run's
weights."""

import json
import math
from functools import partial

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import train.opd as opd_module
import train.recipes.opd as opd_recipe
import train.schema  # noqa: F401  (registers train_schema)
from drafters.dflash import DFlashConfig, DFlashDraft, DFlashDrafter
from drafters.dspark import DSparkConfig, DSparkDraft, DSparkDrafter
from drafters.eagle import EagleConfig, EagleDraft, EagleDrafter, default_layout
from experiments.common import CONF_DIR
from experiments.learning_curves import format_table, run_row
from train import run_training
from train.checkpoint import check_same_run
from train.dflash import DFlashLoss
from train.distill import Answer, encode_until
from train.dspark import DSparkLoss
from train.eagle import EagleLoss
from train.opd import OpdWeights, acceptance_counts, opd_loss, position_weights
from train.prompts import interleave, load_prompt_files
from train.recipes import OPD_DRAFTERS, recipe_for
from train.recipes.opd import rollout_prompts
from train.rollout import Rollout, RolloutStep, roll_out, rollout_batch, target_states
from train.schema import check_settings
from verify.loop import generate
from verify.runtime.features import eagle3_layers
from verify.runtime.model import load_target
from verify.sampling import GREEDY
from verify.tree import TreeTopology

# -- the loss against a hand computation -----------------------------------------------------

DEPTH, VOCAB = 3, 4
ACCEPTED = torch.tensor([[1, 0, 3, 2]])  # a per step; the last step is padding (invalid)
VALID = torch.tensor([[True, True, True, False]])
WEIGHTS = OpdWeights(forward_kl=0.7, reverse_kl=1.3, reject_decay=0.5)


def _toy() -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits and target log-probabilities (1, 4, D, V') of four rollout steps."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, DEPTH, VOCAB, generator=generator)
    target = torch.randn(1, 4, DEPTH, VOCAB, generator=generator).log_softmax(-1)
    return logits, target


def _hand_loss(logits, target_logp, accepted, valid, weights) -> float:
    """The loss written out position by position, with plain floats."""
    total, positions = 0.0, 0
    for step in range(logits.shape[1]):
        if not valid[0, step]:
            continue
        a = int(accepted[0, step])
        for k in range(1, DEPTH + 1):
            q = logits[0, step, k - 1].softmax(-1).tolist()
            p = target_logp[0, step, k - 1].exp().tolist()
            if k <= a:  # accepted: KL(p || q)
                total += weights.forward_kl * sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
            else:  # rejected: KL(q || p), the first rejected position weighing 1
                decay = weights.reject_decay ** (k - a - 1)
                total += weights.reverse_kl * decay * sum(
                    qi * math.log(qi / pi) for pi, qi in zip(p, q))
            positions += 1
    return total / positions


def _matches_hand_computation() -> bool:
    logits, target = _toy()
    loss, parts = opd_loss(logits, target, ACCEPTED, VALID, WEIGHTS)
    expected = _hand_loss(logits, target, ACCEPTED, VALID, WEIGHTS)
    assert float(parts["positions"]) == 3 * DEPTH
    parts_sum = float(parts["forward_kl"] + parts["reverse_kl"]) / float(parts["positions"])
    return math.isclose(float(loss), expected, rel_tol=1e-5) and \
        math.isclose(parts_sum, expected, rel_tol=1e-5)


def test_the_loss_is_forward_kl_where_accepted_and_decayed_reverse_kl_where_rejected():
    assert _matches_hand_computation()


def test_a_loss_with_the_kl_directions_swapped_fails_the_hand_computation(monkeypatch):
    forward, reverse = opd_module.forward_kl, opd_module.reverse_kl
    monkeypatch.setattr(opd_module, "forward_kl", reverse)
    monkeypatch.setattr(opd_module, "reverse_kl", forward)
    assert not _matches_hand_computation()


def test_a_decay_counted_from_the_last_accepted_position_fails_the_hand_computation(
        monkeypatch):
    real = opd_module.position_weights

    def shifted(accepted, depth, weights):  # decay ** (k - a): the first rejected weighs decay
        forward, reverse = real(accepted, depth, weights)
        return forward, reverse * weights.reject_decay
    monkeypatch.setattr(opd_module, "position_weights", shifted)
    assert not _matches_hand_computation()


def test_position_weights_by_accepted_length():
    forward, reverse = position_weights(torch.tensor([[0, 1, 3]]), 3, OpdWeights(1.0, 2.0, 0.5))
    assert forward.tolist() == [[[0, 0, 0], [1, 0, 0], [1, 1, 1]]]
    assert reverse.tolist() == [[[2, 1, 0.5], [0, 2, 1], [0, 0, 0]]]
    _, first_only = position_weights(torch.tensor([[0]]), 3, OpdWeights(1.0, 1.0, 0.0))
    assert first_only.tolist() == [[[1, 0, 0]]]  # reject_decay 0: 0 ** 0 == 1


def _gradient(weights: OpdWeights) -> torch.Tensor:
    """|d loss / d logits| summed over the vocabulary: (4, D), one row per toy step."""
    logits, target = _toy()
    logits.requires_grad_(True)
    opd_loss(logits, target, ACCEPTED, VALID, weights)[0].backward()
    return logits.grad[0].abs().sum(-1)


@pytest.mark.parametrize("weights, reached", [
    # both parts: every drafted position of a valid step, never the padding step
    (WEIGHTS, [[1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0]]),
    # the forward part alone: the accepted positions (k <= a)
    (OpdWeights(1.0, 0.0, 0.5), [[1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]),
    # the reverse part alone: the rejected ones (k > a)
    (OpdWeights(0.0, 1.0, 0.5), [[0, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0]]),
    # no decay left: the first rejected position alone
    (OpdWeights(0.0, 1.0, 0.0), [[0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]),
])
def test_gradients_reach_exactly_the_positions_the_loss_weighs(weights, reached):
    assert (_gradient(weights) > 0).int().tolist() == reached


def test_acceptance_counts_by_depth():
    logits, target = _toy()
    counts = acceptance_counts(logits, target, ACCEPTED, VALID)
    # reached depth k when a >= k - 1 (valid steps a = 1, 0, 3); accepted it when a >= k
    assert counts[:, 0].tolist() == [3, 2, 1] and counts[:, 3].tolist() == [2, 1, 1]
    hits = (logits.argmax(-1) == target.argmax(-1))[0, :3]
    reached = ACCEPTED[0, :3, None] >= torch.arange(DEPTH)
    assert counts[:, 1].tolist() == (hits & reached).sum(0).float().tolist()


# -- rollouts and the packed target forward --------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_target(tiny="llama")


def _drafter(target, chain=3) -> DFlashDrafter:
    torch.manual_seed(1)
    draft = DFlashDraft(target.model, eagle3_layers(2), 4, 1)
    return DFlashDrafter(draft, TreeTopology.chain(chain))


@pytest.mark.parametrize("step", ["eager", "openvino"])  # openvino: the fast step's rollouts
def test_rollouts_follow_the_target_and_record_every_steps_chain_and_acceptance(step):
    torch.manual_seed(0)
    target = load_target(tiny="llama", step=step)
    prompts = [torch.tensor([5, 9, 17, 3]), torch.tensor([40, 41, 42, 43, 40, 41])]
    rollouts = roll_out(target, _drafter(target), 3, prompts, 12, GREEDY)
    for prompt, rollout in zip(prompts, rollouts):
        plain = generate(target.step, prompt, 12, eos_token_id=target.eos_token_ids)
        assert torch.equal(rollout.tokens, torch.cat([prompt, plain.tokens]))
        assert len(rollout.steps) == len(plain.steps)  # every step drafted a chain
        root = len(prompt)
        for step in rollout.steps:  # each step's root follows the last one's accepted + bonus
            assert step.root == root and len(step.drafted) == 3
            a = step.accepted
            decided = rollout.tokens[step.root + 1:step.root + 1 + a]
            assert torch.equal(decided, step.drafted[:len(decided)])
            if step.root + 1 + a < len(rollout.tokens) and a < 3:  # greedy: the bonus differs
                assert int(rollout.tokens[step.root + 1 + a]) != int(step.drafted[a])
            root += a + 1
        assert root >= len(rollout.tokens) - 1


def _learned(kind: str, target, chain: int):
    """A fresh drafter of `kind` drafting chains of `chain` and its supervised objective on
    the same draft (the eagle ones with a draft vocabulary: every other token)."""
    torch.manual_seed(1)
    head = target.model.get_output_embeddings()
    if kind in ("eagle1", "eagle3"):
        layers = (-1,) if kind == "eagle1" else eagle3_layers(2)
        vocab = torch.arange(0, head.weight.shape[0], 2)
        draft = EagleDraft(target.model, layers, vocab, layout=default_layout(kind))
        return (EagleDrafter(draft, TreeTopology.chain(chain)),
                EagleLoss(draft, head, EagleConfig(variant=kind)))
    if kind == "dspark":
        draft = DSparkDraft(target.model, eagle3_layers(2), chain + 1, 1, None, 8, True, 0.5)
        return (DSparkDrafter(draft, TreeTopology.chain(chain)),
                DSparkLoss(draft, head, DSparkConfig(block_size=chain + 1)))
    draft = DFlashDraft(target.model, eagle3_layers(2), chain + 1, 1)
    return (DFlashDrafter(draft, TreeTopology.chain(chain)),
            DFlashLoss(draft, head, DFlashConfig(block_size=chain + 1)))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "dflash", "dspark"])
def test_the_draft_along_its_recorded_chains_gives_the_tokens_it_drafted(kind, tiny):
    # chain_logits is what the loss learns on: greedy rollouts drafted each chain's top-1,
    # so the draft rerun along the recorded chains must pick every drafted token again
    drafter, objective = _learned(kind, tiny, 3)
    prompts = [torch.tensor([5, 9, 17, 3, 8]), torch.tensor([40, 41, 42])]
    rollouts = roll_out(tiny, drafter, 3, prompts, 16, GREEDY)
    scored = [target_states(tiny.model, r, drafter.feature_layers, 3) for r in rollouts]
    batch = rollout_batch(rollouts, [f for f, _ in scored], [s for _, s in scored])
    objective.eval()
    with torch.no_grad():
        logits = objective.chain_logits(batch["input_ids"], batch["features"], batch["starts"],
                                        batch["valid"], batch["drafted"])
    picked = logits.argmax(-1)
    vocab = objective.draft.vocab_ids
    picked = picked if vocab is None else vocab[picked]
    valid = batch["valid"]
    assert int(valid.sum()) >= 6 and torch.equal(picked[valid], batch["drafted"][valid])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_packed_forward_gives_what_separate_forwards_do(kind):
    target = load_target(tiny=kind)
    tokens = torch.randint(0, 200, (12,), generator=torch.Generator().manual_seed(0))
    steps = [RolloutStep(4, torch.tensor([5, 6, 7]), 1),
             RolloutStep(6, torch.tensor([9, 10, 11]), 0),
             RolloutStep(7, torch.tensor([1, 2, 3]), 3)]
    layers = (1, 2)
    features, states = target_states(target.model, Rollout(tokens, 4, steps), layers, 3)
    with torch.no_grad():
        hidden = target.model.base_model(input_ids=tokens[None],
                                         output_hidden_states=True).hidden_states
        assert torch.allclose(features, torch.cat([hidden[i][0] for i in layers], -1),
                              atol=1e-5)
        for s, step in enumerate(steps):
            for k in range(3):  # position k + 1 learns from the state after d_1..d_k
                alone = torch.cat([tokens[:step.root + 1], step.drafted[:k]])
                last = target.model.base_model(input_ids=alone[None],
                                               output_hidden_states=True).hidden_states[-1]
                assert torch.allclose(states[s, k], last[0, -1], atol=1e-5), (s, k)


# -- the config and its refusals -------------------------------------------------------------

def _compose(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("train", ["out_dir=/tmp/unused", *overrides])


def test_stage_opd_composes_typed_with_its_defaults():
    cfg = _compose("drafter=dflash", "stage=opd", "opd.reject_decay=0.25")
    assert cfg.stage == "opd" and cfg.opd.reject_decay == 0.25
    assert cfg.opd.prompts_per_step == 4 and cfg.opd.temperature == 0.0 and cfg.opd.chain is None
    assert _compose("drafter=dflash").stage == "sft"
    with pytest.raises(Exception, match="opd.reject_decay"):
        _compose("stage=opd", "opd.reject_decay=fast")
    with pytest.raises(Exception, match="rejected_decay"):
        _compose("stage=opd", "opd.rejected_decay=0.5")


@pytest.mark.parametrize("overrides, message", [
    (["stage=rl"], "stage must be one of"),
    (["opd.reject_decay=1.5"], r"opd.reject_decay must be in \[0, 1\]"),
    (["opd.prompts_per_step=0"], "opd.prompts_per_step must be at least 1"),
    (["opd.forward_kl_weight=0", "opd.reverse_kl_weight=0"], "not both 0"),
    (["opd.prompts=heldout"], "opd.prompts must be one of"),
])
def test_opd_settings_a_run_cannot_mean_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_settings(_compose("drafter=dflash", "stage=opd", *overrides))


def test_every_drafter_with_opd_has_its_recipes_parts():
    for name in OPD_DRAFTERS:
        assert callable(recipe_for(name).opd_parts), name


def test_rollout_prompts_are_training_prompts_never_held_out_ones(tiny):
    cfg = _compose("experiment=smoke", "drafter=dflash", "stage=opd", "opd.prompts=files")
    data = cfg.data
    texts = interleave(load_prompt_files(data.root, list(data.sources)), data.seed)
    heldout = encode_until(tiny, texts, data.heldout_prompts, data.max_prompt_tokens)
    files = rollout_prompts(cfg, tiny, [], [], (1, 2), 3)
    assert len(files) > 100 and not any(torch.equal(p, h) for p in files for h in heldout)
    assert torch.equal(files[0], encode_until(tiny, texts, data.heldout_prompts + 1,
                                              data.max_prompt_tokens)[-1])
    cfg.opd.prompts = "data"  # the distilled answers' prompts (experiment=smoke reads no ShareGPT)
    answers = [Answer(torch.tensor([3, 4, 5]), torch.tensor([6, 7]), None),
               Answer(torch.tensor([3, 4, 5]), torch.tensor([8]), None),  # a duplicate
               Answer(torch.tensor([9]), torch.tensor([1]), None)]
    prompts = rollout_prompts(cfg, tiny, answers, heldout, (1, 2), 3)
    assert [p.tolist() for p in prompts] == [[3, 4, 5], [9]]


@pytest.fixture
def no_target(monkeypatch):
    def refuse(*args):
        raise AssertionError("the target was loaded")
    monkeypatch.setattr(opd_recipe.common, "training_target", refuse)


@pytest.mark.parametrize("drafter", ["medusa", "draft_model", "pard"])
def test_a_drafter_without_opd_is_refused_naming_the_ones_with_it(drafter, no_target, tmp_path):
    cfg = _compose(f"drafter={drafter}", "stage=opd", f"out_dir={tmp_path}")
    with pytest.raises(ValueError, match=f"drafter={drafter} has no Draft-OPD; the drafters "
                                         "that have it: eagle, eagle3, dflash, dspark"):
        run_training(cfg)


def test_opd_without_a_checkpoint_or_with_a_chain_past_the_block_is_refused(no_target,
                                                                           tmp_path):
    with pytest.raises(ValueError, match="set drafter.checkpoint=<run>/checkpoint"):
        run_training(_compose("drafter=dflash", "stage=opd", f"out_dir={tmp_path}"))
    with pytest.raises(ValueError, match="opd.chain=8 is longer than the block"):
        run_training(_compose("drafter=dflash", "stage=opd", "drafter.checkpoint=x",
                              "opd.chain=8", f"out_dir={tmp_path}"))


def test_a_run_saved_before_stages_resumes_as_sft_and_an_sft_run_reads_no_opd_key(tmp_path):
    asked = {"stage": "sft", "opd": {"reject_decay": 0.5}, "seed": 0}
    check_same_run(tmp_path, {"seed": 0}, asked)  # saved before stage and opd existed
    check_same_run(tmp_path, {"stage": "sft", "opd": {"reject_decay": 0.9}, "seed": 0}, asked)
    with pytest.raises(ValueError, match="stage: saved 'sft', asked 'opd'"):
        check_same_run(tmp_path, {"seed": 0}, {**asked, "stage": "opd"})
    with pytest.raises(ValueError, match="opd.reject_decay: saved 0.9, asked 0.5"):
        check_same_run(tmp_path, {"stage": "opd", "opd": {"reject_decay": 0.9}, "seed": 0},
                       {**asked, "stage": "opd"})


# -- a tiny run after a supervised one -------------------------------------------------------

@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A DFlash draft trained a few steps on the tiny Llama (experiment=smoke); its folder."""
    folder = tmp_path_factory.mktemp("sft")
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("train", ["experiment=smoke", "drafter=dflash", f"out_dir={folder / 'run'}",
                                f"data.cache_dir={folder / 'cache'}"])
    run_training(cfg)
    return folder


def _opd_cfg(sft, tmp_path, *overrides, out="opd"):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("train", [
            "experiment=smoke", "drafter=dflash", "stage=opd",
            f"drafter.checkpoint={sft / 'run' / 'checkpoint'}", f"out_dir={tmp_path / out}",
            f"data.cache_dir={sft / 'cache'}", "opd.prompts_per_step=2", "opd.max_new_tokens=8",
            *overrides])


def test_opd_trains_from_the_checkpoint_evaluates_and_records_its_curve(sft_run, tmp_path):
    before = load_file(str(sft_run / "run" / "checkpoint" / "draft.safetensors"))
    results = run_training(_opd_cfg(sft_run, tmp_path, "curve_every=2"))
    after = load_file(str(tmp_path / "opd" / "checkpoint" / "draft.safetensors"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k])
                                                 for k in before)
    written = json.loads((tmp_path / "opd" / "eval.json").read_text())
    assert written["stage"] == "opd" and written["config"]["stage"] == "opd"
    rollouts = written["rollouts"]
    assert rollouts["steps"] > 0 and len(rollouts["acceptance"]) == 3  # smoke: blocks of 4
    assert math.isclose(rollouts["tau"], 1 + sum(rollouts["acceptance"]))
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
    row = run_row(tmp_path / "opd")
    assert [p["step"] for p in row["curve"]] == [2, 4] and row["drafter"] == "DFlash + OPD"
    assert all("tau" in p["rollout"] and p["train_cpu_seconds"] > 0 for p in row["curve"])
    assert "rollout tau" in format_table([row])


def test_opd_refuses_another_targets_or_another_drafters_checkpoint(sft_run, tmp_path):
    with pytest.raises(ValueError, match="trained on 'tiny-llama'"):
        run_training(_opd_cfg(sft_run, tmp_path, "target=tiny_qwen2"))
    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"num_heads": 2, "target": {}}))
    with pytest.raises(ValueError, match="but the DFlash drafter needs"):
        run_training(_opd_cfg(sft_run, tmp_path, f"drafter.checkpoint={medusa}"))


def test_a_resumed_opd_run_ends_with_the_uninterrupted_runs_weights(sft_run, tmp_path,
                                                                    resumes_exactly):
    # sampled rollouts: the generator a step draws from must come back on resume too
    make = partial(_opd_cfg, sft_run, tmp_path, "opd.temperature=1.0")
    run_training(make(out="whole"))
    resumes_exactly(make, tmp_path, "draft.safetensors", batches=opd_recipe)


def test_an_eagle3_draft_takes_the_stage_after_its_supervised_run(tmp_path):
    # EAGLE's rollouts draft through the EAGLE engine and learn along the unrolled chain
    with initialize_config_dir(CONF_DIR, version_base=None):
        base = ["experiment=eagle_smoke", f"data.cache_dir={tmp_path / 'cache'}"]
        run_training(compose("train", [*base, f"out_dir={tmp_path / 'sft'}"]))
        cfg = compose("train", [*base, "stage=opd", "opd.prompts_per_step=2",
                                "opd.max_new_tokens=8", "curve_every=2",
                                f"drafter.checkpoint={tmp_path / 'sft' / 'checkpoint'}",
                                f"out_dir={tmp_path / 'opd'}"])
    results = run_training(cfg)
    before = load_file(str(tmp_path / "sft" / "checkpoint" / "draft.safetensors"))
    after = load_file(str(tmp_path / "opd" / "checkpoint" / "draft.safetensors"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k])
                                                 for k in before)
    rollouts = json.loads((tmp_path / "opd" / "eval.json").read_text())["rollouts"]
    assert rollouts["steps"] > 0 and len(rollouts["acceptance"]) == 3  # eval.depth's chain
    assert len(results["accuracy"]["top1"]) == cfg.eval.depth  # EAGLE's held-out depths
    assert results["decoding"]["identical"] == results["decoding"]["prompts"]
    assert run_row(tmp_path / "opd")["drafter"] == "EAGLE-3 + OPD"


@pytest.mark.slow
def test_the_stage_raises_how_much_of_its_own_chains_the_target_accepts(tmp_path):
    # what the stage is for, end to end on a tiny target: learning from the target's feedback
    # on the draft's own chains raises the share of them it accepts (rollouts' depth-1
    # acceptance, 0.02 in the first window); a target distribution read at the wrong
    # positions would teach other tokens and leave it flat
    with initialize_config_dir(CONF_DIR, version_base=None):
        base = ["experiment=eagle_smoke", f"data.cache_dir={tmp_path / 'cache'}"]
        run_training(compose("train", [*base, f"out_dir={tmp_path / 'sft'}"]))
        run_training(compose("train", [
            *base, "stage=opd", "opd.prompts_per_step=2", "opd.max_new_tokens=16",
            "optim.max_steps=200", "optim.lr=1e-2", "curve_every=50", "save_every=100",
            f"drafter.checkpoint={tmp_path / 'sft' / 'checkpoint'}",
            f"out_dir={tmp_path / 'opd'}"]))
    rows = json.loads((tmp_path / "opd" / "curve.json").read_text())["rows"]
    first, last = (rows[i]["rollout"]["acceptance"][0] for i in (0, -1))
    assert last >= 0.2 and last >= 3 * first, (first, last)
