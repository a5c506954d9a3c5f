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


def recipe_for(drafter: str) -> ModuleType | None:
    """The recipe module that trains `drafter`, or None for drafters without weights."""
    return importlib.import_module(RECIPES[drafter]) if drafter in RECIPES else None
