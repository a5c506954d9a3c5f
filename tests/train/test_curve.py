"""Learning curves (train.curve, curve_every): rows at the asked steps, the same curve and
weights for an interrupted-and-resumed run as for an uninterrupted one, no effect on what the
run trains, and settings the curve cannot keep refused before anything loads."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import train.features as features_module
from experiments.common import CONF_DIR
from experiments.learning_curves import run_row
from train import run_training
from train.curve import CURVE_FILE, read_curve

SAME_EVERY_RUN = ("step", "tokens", "top1", "top5")  # the clocks differ from run to run


def _cfg(tmp_path, preset, *overrides, out="run"):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose("train", [f"experiment={preset}", f"out_dir={tmp_path / out}",
                                 f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def _curve(tmp_path, out):
    return [{k: r[k] for k in SAME_EVERY_RUN} for r in read_curve(tmp_path / out / CURVE_FILE)]


def _weights(tmp_path, out, name):
    return load_file(str(tmp_path / out / "checkpoint" / name))


def test_an_eagle_curve_has_its_rows_and_survives_an_interruption(tmp_path, interrupt):
    run_training(_cfg(tmp_path, "eagle_smoke", "curve_every=1", out="whole"))
    whole = _curve(tmp_path, "whole")
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    assert all(len(r["top1"]) == 3 for r in whole)  # eval.depth of the preset
    tokens = [r["tokens"] for r in whole]
    assert tokens == sorted(tokens) and tokens[0] > 0 and len(set(tokens)) == 4
    rows = read_curve(tmp_path / "whole" / CURVE_FILE)
    assert all(r["train_cpu_seconds"] > 0 and r["eval_seconds"] >= 0 for r in rows)
    assert run_row(tmp_path / "whole")["drafter"] == "EAGLE-3"  # what the report reads

    resume = interrupt(features_module, 3)  # after the checkpoint (and the row) of step 2
    with pytest.raises(KeyboardInterrupt):
        run_training(_cfg(tmp_path, "eagle_smoke", "curve_every=1", out="cut"))
    assert [r["step"] for r in _curve(tmp_path, "cut")] == [1, 2, 3]  # step 3's row, no save
    resume()
    run_training(_cfg(tmp_path, "eagle_smoke", "curve_every=1", out="cut"))
    assert _curve(tmp_path, "cut") == whole  # step 3 evaluated again, once

    run_training(_cfg(tmp_path, "eagle_smoke", out="plain"))  # no curve: the same draft
    plain, curved = (_weights(tmp_path, out, "draft.safetensors") for out in ("plain", "whole"))
    assert all(torch.equal(plain[k], curved[k]) for k in plain)
    assert not (tmp_path / "plain" / CURVE_FILE).exists()


def test_a_dflash_curve_leaves_the_anchors_it_draws_alone(tmp_path):
    """DFlash samples its training anchors from the global generator: an evaluation drawing
    from it would shift every later batch's anchors."""
    run_training(_cfg(tmp_path, "smoke", "drafter=dflash", "curve_every=2", out="curved"))
    run_training(_cfg(tmp_path, "smoke", "drafter=dflash", out="plain"))
    curve = _curve(tmp_path, "curved")
    assert [r["step"] for r in curve] == [2, 4] and len(curve[0]["top1"]) >= 1
    plain, curved = (_weights(tmp_path, out, "draft.safetensors") for out in ("plain", "curved"))
    assert all(torch.equal(plain[k], curved[k]) for k in plain)


def test_curve_settings_it_cannot_keep_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="save_every=2 is not a multiple of curve_every=3"):
        run_training(_cfg(tmp_path, "eagle_smoke", "curve_every=3", "optim.max_steps=8"))
    with pytest.raises(ValueError, match="curve_every must be >= 0"):
        run_training(_cfg(tmp_path, "eagle_smoke", "curve_every=-1"))
    with pytest.raises(ValueError, match="medusa recipe has no held-out evaluation"):
        run_training(_cfg(tmp_path, "smoke", "curve_every=2"))


@pytest.mark.parametrize("drafter", ["eagle", "eagle3", "dflash"])
def test_the_onpolicy_preset_trains_on_regenerated_answers_with_a_resumable_curve(drafter):
    from train.recipes import recipe_for
    from train.schema import check_settings
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("train", ["experiment=onpolicy", f"drafter={drafter}",
                                "data.conversations=/regenerated"])
    check_settings(cfg)  # save_every a multiple of curve_every: a resumed run keeps its curve
    assert cfg.data.name == "regenerated" and cfg.data.conversations == "/regenerated"
    assert cfg.curve_every > 0 and cfg.optim.max_steps % cfg.curve_every == 0
    assert cfg.out_dir.endswith(f"/{drafter}/onpolicy")
    assert recipe_for(drafter).LEARNING_CURVE
