"""build_drafter: every registered drafter builds from its shipped config and follows the
protocol; unknown names and trees a drafter cannot fill are refused at construction."""

import pytest
from omegaconf import OmegaConf

from drafters import DRAFTERS, build_drafter
from verify.protocol import Drafter
from verify.tree import TreeError

TINY_OVERRIDES = {"draft_model": {"num_layers": 1}}  # tiny targets have 2 layers


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_each_registered_drafter_builds_from_its_config(name, tiny, conf):
    cfg = OmegaConf.merge(conf("drafter", name), TINY_OVERRIDES.get(name, {}))
    drafter = build_drafter(cfg, conf("tree", "tree8"), tiny("llama"))
    assert isinstance(drafter, Drafter)
    assert isinstance(drafter.feature_layers, tuple)  # medusa reads the target's last state


def test_an_unknown_drafter_is_refused_with_the_known_names(tiny, conf):
    with pytest.raises(ValueError, match=r"unknown drafter 'nope'.*'draft_model'.*'prompt_lookup'"):
        build_drafter({"name": "nope"}, conf("tree", "chain4"), tiny("llama"))


def test_a_tree_deeper_than_prompt_lookup_can_fill_is_refused(tiny, conf):
    cfg = OmegaConf.merge(conf("drafter", "prompt_lookup"), {"max_depth": 4})
    build_drafter(cfg, conf("tree", "chain4"), tiny("llama"))
    with pytest.raises(TreeError, match="tree depth 8 exceeds what prompt_lookup can fill"):
        build_drafter(cfg, conf("tree", "chain8"), tiny("llama"))


def test_the_draft_model_fills_any_depth(tiny):
    chain = {"choices": [[0] * d for d in range(1, 21)]}
    cfg = {"name": "draft_model", "path": None, "num_layers": 1}
    assert build_drafter(cfg, chain, tiny("llama")).tree.depth == 20


@pytest.mark.parametrize("name", ["medusa", "prompt_lookup"])
def test_static_tree_drafters_refuse_a_dynamic_tree(name, tiny, conf):
    cfg = OmegaConf.merge(conf("drafter", name), TINY_OVERRIDES.get(name, {}))
    with pytest.raises(TreeError, match="fills static trees"):
        build_drafter(cfg, conf("tree", "eagle2"), tiny("llama"))


def test_a_tree_config_of_neither_kind_is_refused(tiny, conf):
    with pytest.raises(TreeError, match="neither `choices`"):
        build_drafter(conf("drafter", "prompt_lookup"), {"name": "odd", "depth": 3}, tiny("llama"))
