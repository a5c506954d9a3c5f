"""Compose the training config the way `python train.py` does, with smoke-sized overrides."""

import pytest
from hydra import compose, initialize_config_dir

import train.schema  # noqa: F401  (registers train_schema)
from experiments.common import CONF_DIR


@pytest.fixture
def train_cfg(tmp_path):
    """train_cfg(*overrides) -> the smoke experiment on a tiny target, writing under tmp_path."""
    def make(*overrides, out="run"):
        with initialize_config_dir(CONF_DIR, version_base=None):
            return compose("train", ["experiment=smoke", f"out_dir={tmp_path / out}",
                                     f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    return make


@pytest.fixture
def interrupt(monkeypatch):
    """interrupt(recipe_module, step): the recipe's next run stops with KeyboardInterrupt
    when it asks for step `step`'s batch, as a Ctrl-C there would; returns a function that
    lets the following runs go through."""
    def arm(recipe, step: int):
        real = recipe.batch_indices

        def interrupted(at, *args):
            if at == step:
                raise KeyboardInterrupt
            return real(at, *args)
        monkeypatch.setattr(recipe, "batch_indices", interrupted)
        return lambda: monkeypatch.setattr(recipe, "batch_indices", real)
    return arm
