"""keep_every: copies of the draft along a run, each loadable and benchmarked together
(experiments.bench kept=<out_dir>); the settings it cannot follow are refused."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from drafters import build_drafter
from experiments.common import CONF_DIR
from experiments.methods import contenders
from train import run_training
from train.schema import check_settings
from verify.runtime.model import load_target


def _eagle(tmp_path, *overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("train", ["experiment=eagle_smoke", f"out_dir={tmp_path / 'run'}",
                                 f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def _bench(*overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("bench", ["target=tiny_llama", "drafter=eagle3", "tree=chain4",
                                 *overrides])


def test_a_run_keeps_the_draft_of_every_keep_step_and_each_loads(tmp_path):
    run_training(_eagle(tmp_path, "keep_every=2"))  # 4 steps, saved every 2
    kept = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == ["step-2", "step-4"]
    assert not (kept / "step-2" / "training_state.pt").exists()  # the draft alone
    last = load_file(str(tmp_path / "run" / "checkpoint" / "draft.safetensors"))
    step4 = load_file(str(kept / "step-4" / "draft.safetensors"))
    step2 = load_file(str(kept / "step-2" / "draft.safetensors"))
    assert all(torch.equal(last[k], step4[k]) for k in last)  # the run's end is kept as is
    assert any(not torch.equal(step2[k], step4[k]) for k in step2)  # the run moved between
    cfg = _bench(f"kept={tmp_path / 'run'}")
    names = [c.name for c in contenders(cfg)]
    assert names == ["eagle3/chain4", "eagle3/chain4 (step 2)", "eagle3/chain4 (step 4)"]
    target = load_target(tiny="llama")
    drafter = build_drafter(contenders(cfg)[1].drafter, cfg.tree, target)
    assert torch.equal(drafter.draft.lm_head.weight.cpu(), step2["lm_head.weight"])


def test_kept_drafts_run_in_step_order_and_a_run_without_any_is_refused(tmp_path):
    for step in (10, 2, 100):
        (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    names = [c.name for c in contenders(_bench(f"kept={tmp_path}"))]
    assert names[1:] == [f"eagle3/chain4 (step {s})" for s in (2, 10, 100)]
    with pytest.raises(ValueError, match="holds no kept drafts.*keep_every=<steps>"):
        contenders(_bench(f"kept={tmp_path / 'nothing'}"))


@pytest.mark.parametrize("overrides, message", [
    (["keep_every=3"], "keep_every=3 is not a multiple of save_every=2"),
    (["keep_every=-1"], "keep_every must be >= 0"),
])
def test_keep_settings_the_saves_cannot_follow_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_settings(_eagle(tmp_path, *overrides))


@pytest.mark.parametrize("drafter", ["eagle", "eagle3", "dflash"])
def test_the_long_preset_trains_on_a_corpus_with_a_curve_and_ten_kept_drafts(drafter):
    from train.recipes import recipe_for

    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("train", ["experiment=corpus_long", f"drafter={drafter}",
                                "data.corpus=/corpus"])
    check_settings(cfg)  # keep_every a multiple of save_every, save_every of curve_every
    assert cfg.data.name == "corpus" and cfg.data.corpus == "/corpus"
    assert cfg.optim.max_steps == 10 * cfg.keep_every and cfg.curve_every > 0
    assert cfg.out_dir.endswith(f"/{drafter}/corpus-long")
    assert recipe_for(drafter).LEARNING_CURVE
