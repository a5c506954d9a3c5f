"""build_drafter: every registered drafter builds from its shipped config and follows the
protocol; unknown names and trees a drafter cannot fill are refused at construction."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from drafters import COMBINATORS, DRAFTERS, build_drafter, draft_step, rule_refusal
from verify.accept import RuleRefusal
from verify.loop import generate
from verify.protocol import Drafter
from verify.sampling import SamplingParams
from verify.tree import TreeError

TINY_OVERRIDES = {"draft_model": {"num_layers": 1}, "pard": {"num_layers": 1}}  # 2-layer targets
OWN_TREES = {"suffix": "suffix", "hybrid": "suffix"}  # drafters that grow their own kind


@pytest.mark.parametrize("name", sorted([*DRAFTERS, *COMBINATORS]))
def test_each_registered_drafter_builds_from_its_config(name, tiny, conf):
    cfg = OmegaConf.merge(conf("drafter", name), TINY_OVERRIDES.get(name, {}))
    drafter = build_drafter(cfg, conf("tree", OWN_TREES.get(name, "tree8")), tiny("llama"))
    assert isinstance(drafter, Drafter)
    assert isinstance(drafter.feature_layers, tuple)  # medusa reads the target's last state


def test_where_a_learned_draft_runs_is_asked_of_the_target_step():
    # drafter.step=null: where the step runs drafts by default (its draft_steps' first)
    beside_openvino = SimpleNamespace(draft_steps=("openvino", "torch"))
    beside_torch = SimpleNamespace(draft_steps=("torch",))
    assert draft_step(None, beside_openvino, "eagle") == "openvino"
    assert draft_step(None, beside_torch, "eagle") == "torch"
    assert draft_step("torch", beside_openvino, "eagle") == "torch"
    with pytest.raises(ValueError, match="set target.step=openvino"):
        draft_step("openvino", beside_torch, "eagle")


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


def test_the_suffix_drafter_refuses_a_static_tree(tiny, conf):
    with pytest.raises(TreeError, match="grows its own trees"):
        build_drafter(conf("drafter", "suffix"), conf("tree", "chain4"), tiny("llama"))


def test_a_cost_on_a_static_tree_is_refused(tiny, conf):
    tree = OmegaConf.merge(conf("tree", "chain4"), {"cost": {"t_ms": {1: 10, 2: 11}}})
    with pytest.raises(TreeError, match="static tree has no node scores"):
        build_drafter(conf("drafter", "prompt_lookup"), tree, tiny("llama"))


def test_a_hybrid_with_an_unknown_member_is_refused_with_the_known_names(tiny, conf):
    cfg = OmegaConf.merge(conf("drafter", "hybrid"), {"members": ["suffix", "nope"]})
    with pytest.raises(ValueError, match=r"unknown hybrid member 'nope'.*'eagle'.*'suffix'"):
        build_drafter(cfg, conf("tree", "suffix"), tiny("llama"))


def test_hybrid_members_get_their_own_options_and_tree(tiny, conf):
    drafter = build_drafter(conf("drafter", "hybrid"), conf("tree", "suffix"), tiny("llama"))
    suffix, eagle = (member.drafter for member in drafter.members)
    assert suffix.tree.total_tokens == 16  # the shared tree config
    assert (eagle.tree.depth, eagle.tree.top_k, eagle.tree.total_tokens) == (2, 2, 2)
    assert drafter.feature_layers == eagle.feature_layers  # the suffix reads none


# (drafter, its overrides, tree): each registered drafter with a model, and the trees that
# change what it proposes (a dynamic tree, a DDTree, siblings drawn i.i.d.). The model-free
# ones find no match in a random model's output, so their runs verify no tree at all (the
# bench's parse tests cover their refusals); the hybrid's suffix member hands over to EAGLE.
MODEL_FREE = ("prompt_lookup", "recycling", "suffix")
PROPOSALS = [(name, TINY_OVERRIDES.get(name, {}), OWN_TREES.get(name, "tree8"))
             for name in sorted([*DRAFTERS, *COMBINATORS]) if name not in MODEL_FREE] + [
    ("eagle", {}, "eagle2"), ("dflash", {}, "ddtree8"),
    ("draft_model", {"num_layers": 1, "iid_siblings": True}, "tree8")]
PROMPT = torch.arange(40, 50)


@pytest.mark.parametrize("name, overrides, tree", PROPOSALS,
                         ids=[f"{n}-{t}{'-iid' if o.get('iid_siblings') else ''}"
                              for n, o, t in PROPOSALS])
def test_the_rules_refused_before_loading_are_the_ones_the_trees_would_refuse(
        name, overrides, tree, tiny, conf):
    # rule_refusal judges from the configs alone; the rules judge each tree while decoding:
    # they must agree
    drafter_cfg, tree_cfg = OmegaConf.merge(conf("drafter", name), overrides), conf("tree", tree)
    for rule in ("traversal", "spectr"):
        refusal = rule_refusal(rule, drafter_cfg, tree_cfg)
        drafter = build_drafter(drafter_cfg, tree_cfg, tiny("llama"))
        try:
            generate(tiny("llama").model, PROMPT, 6, drafter=drafter,
                     sampling=SamplingParams(1.0), rule=rule,
                     generator=torch.Generator().manual_seed(0))
        except RuleRefusal as refused:
            assert refusal is not None, f"{rule} refused only while decoding: {refused}"
        else:
            assert refusal is None, f"{rule} refused, yet every tree was verified: {refusal}"
