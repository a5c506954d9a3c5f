"""Every shipped config composes, and every config group option works with every command."""

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.common import CONF_DIR
from verify.target import load_target_from_config
from verify.tree import TreeTopology

GROUPS = {group: sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
          for group in ("target", "drafter", "tree")}
COMMANDS = ["correctness", "bench", "train"]


def compose_with(command, *overrides):
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose(command, list(overrides))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("group, option",
                         [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_group_option_composes_with_every_command(command, group, option):
    cfg = compose_with(command, f"{group}={option}")
    assert cfg[group].name  # every option names itself for result tables and file names


@pytest.mark.parametrize("tree", GROUPS["tree"])
def test_tree_configs_are_valid_topologies(tree):
    cfg = compose_with("bench", f"tree={tree}")
    topology = TreeTopology.from_choices(cfg.tree.choices)
    assert topology.size - 1 == len(cfg.tree.choices)


@pytest.mark.parametrize("target", [t for t in GROUPS["target"] if t.startswith("tiny")])
def test_tiny_target_configs_load(target):
    cfg = compose_with("bench", f"target={target}")
    assert load_target_from_config(cfg.target).model.config.vocab_size == 256


def test_train_entry_prints_its_config(capsys):
    # `import train` finds the train/ package: load the root script by its path
    spec = importlib.util.spec_from_file_location("train_entry", Path(CONF_DIR).parent / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    train.main(compose_with("train", "drafter=prompt_lookup"))
    out = capsys.readouterr().out
    assert "name: prompt_lookup" in out and "nothing to train" in out


def test_an_unknown_group_option_is_refused():
    with pytest.raises(Exception, match="nope"):
        compose_with("bench", "drafter=nope")


# tree_search times the target alone: it has no drafter or tree group to compose with.
@pytest.mark.parametrize("target", GROUPS["target"])
def test_every_target_composes_with_tree_search(target):
    assert compose_with("tree_search", f"target={target}").target.name
