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
