"""Fixtures shared by the drafter tests: tiny random targets and the shipped configs."""

from functools import cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.common import CONF_DIR
from verify.runtime.model import load_target
from verify.tree import TreeTopology

CONF = Path(CONF_DIR)


@cache
def _tiny(arch: str):
    return load_target(tiny=arch)


@pytest.fixture(scope="session")
def tiny():
    """tiny(arch) -> the Target of a tiny random model, built once per session (read-only)."""
    return _tiny


@pytest.fixture(scope="session")
def conf_dir() -> Path:
    return CONF


@pytest.fixture(scope="session")
def conf():
    """conf(group, name) -> the shipped conf/<group>/<name>.yaml as a DictConfig."""
    return lambda group, name: OmegaConf.load(CONF / group / f"{name}.yaml")


@pytest.fixture(scope="session")
def topology(conf):
    """topology(tree_name) -> the TreeTopology of conf/tree/<tree_name>.yaml."""
    return lambda name: TreeTopology.from_choices(conf("tree", name).choices)
