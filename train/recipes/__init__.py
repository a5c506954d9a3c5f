"""One recipe per learned drafter, each with torchtune's skeleton: setup (target, data, drafter,
objective, optimizer), train (train.loop.train_steps, resumable checkpoints), save, evaluate
(held-out accuracy, and tau through build_drafter and the decoding loop itself).

A new learned drafter is one module here with `drafter_config(cfg)` (its drafter settings,
refused from cfg alone: run_training asks before it makes the out_dir), `run(cfg, env, group)
-> results` (and `LEARNING_CURVE = True` when it hands common.Training a held-out evaluation for
curve_every) and one entry below; modules are imported only when their drafter is trained.
The scaffolding every recipe shares (the training target, resuming, checkpoints, eval.json) is
train.recipes.common: a recipe builds its model, data and objective and hands them to
`common.train_and_evaluate`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# conf/drafter name -> the module whose run() trains it
RECIPES = {
    "draft_model": "train.recipes.draft_model",
    "medusa": "train.recipes.medusa",
    "eagle": "train.recipes.eagle",
    "eagle3": "train.recipes.eagle",
    "dflash": "train.recipes.dflash",
    "dspark": "train.recipes.dspark",
    "pard": "train.recipes.pard",
}

# stage=opd (train.recipes.opd, Draft-OPD after supervised training): the drafters whose
# recipe gives it `opd_chain(cfg, config)` (the rollout chain) and `opd_parts(cfg, target,
# draft)` (train.recipes.opd.OpdParts)
OPD_DRAFTERS = ("eagle", "eagle3", "dflash", "dspark")
STAGE_RECIPES = {"opd": "train.recipes.opd"}  # stage -> the module that runs it (sft: RECIPES)


def recipe_for(drafter: str, stage: str = "sft") -> ModuleType | None:
    """The recipe module that trains `drafter` at `stage` (sft: the drafter's own, None for
    drafters without weights; another stage: the stage's, which refuses drafters it cannot
    train)."""
    if stage in STAGE_RECIPES:
        return importlib.import_module(STAGE_RECIPES[stage])
    return importlib.import_module(RECIPES[drafter]) if drafter in RECIPES else None
