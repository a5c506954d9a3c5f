"""Drafters: each proposes a TokenTree for the shared verifier (see verify.protocol).

A new drafter is one module here with a `from_config(cfg, tree, target)` builder, one entry
in DRAFTERS, one YAML in conf/drafter/, and one row in tests/drafters/test_drafter_table.py.
A model-free drafter subclasses drafters.base.StatelessDrafter and writes `propose` (or
StatelessBatchDrafter and `propose_batch`); one running a model over the tree with a draft KV
cache subclasses drafters.engine.EngineDrafter and writes its catch-up and per-level forward.
tests/drafters/toy_drafter.py follows the recipe.
The drafter owns its tree policy: `tree` is a static TreeTopology (conf/tree with `choices`)
or EAGLE-2's DynamicTree (conf/tree with `depth`, `top_k`, `total_tokens`); a drafter that
cannot grow a dynamic tree refuses one with a TreeError. A combinator (COMBINATORS: hybrid)
builds its member drafters through `build_drafter` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from drafters import (
    dflash,
    draft_model,
    eagle,
    hybrid,
    medusa,
    pard,
    prompt_lookup,
    recycling,
    suffix,
)
from drafters.adaptive import measured_cost
from drafters.block import DDTree
from drafters.dynamic_tree import DynamicTree
from verify.protocol import Drafter
from verify.rules import RULES, RuleConfig, rule_parts
from verify.target import Target
from verify.tree import TreeError, TreeTopology

TreePolicy = TreeTopology | DynamicTree | DDTree
# Drafters whose one forward gives every depth's distribution (drafters.block): the only ones
# that can fill a DDTree.
BLOCK_DRAFTERS = ("dflash", "pard")
DrafterBuilder = Callable[[Mapping, TreePolicy, Target], Drafter]

DRAFTERS: dict[str, DrafterBuilder] = {
    "dflash": dflash.from_config,
    "draft_model": draft_model.from_config,
    "eagle": eagle.from_config,
    "eagle3": eagle.from_config,
    "medusa": medusa.from_config,
    "pard": pard.from_config,
    "prompt_lookup": prompt_lookup.from_config,
    "recycling": recycling.from_config,
    "suffix": suffix.from_config,
}
# Combinators build their members through build_drafter, from the raw tree config.
COMBINATORS = {"hybrid": hybrid.from_config}


def build_drafter(drafter_cfg: Mapping, tree_cfg: Mapping, target: Target) -> Drafter:
    """The drafter named by `drafter_cfg["name"]` (a conf/drafter/*.yaml mapping), growing the
    tree `tree_cfg` (conf/tree/*.yaml) describes, for `target`.

    Raises ValueError for an unknown name and TreeError for a tree the drafter cannot fill.
    """
    name = drafter_cfg["name"]
    tree_cfg = measured_cost(tree_cfg, target.step)  # once, before any member is built
    if name in COMBINATORS:
        return COMBINATORS[name](drafter_cfg, tree_cfg, tree_policy(tree_cfg), target,
                                 build_drafter)
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known drafters: "
                         f"{sorted([*DRAFTERS, *COMBINATORS])}")
    policy = tree_policy(tree_cfg)
    if isinstance(policy, DDTree) and name not in BLOCK_DRAFTERS:
        raise TreeError(f"tree {tree_cfg.get('name')!r} is a DDTree, built from a block "
                        f"drafter's per-position marginals: drafter {name!r} has none (block "
                        f"drafters: {list(BLOCK_DRAFTERS)})")
    return DRAFTERS[name](drafter_cfg, policy, target)


def tree_policy(tree_cfg: Mapping) -> TreePolicy:
    """A static topology for a config with `choices`, a DDTree for one with `policy: ddtree`,
    a DynamicTree for one with `total_tokens`."""
    if "choices" in tree_cfg:
        if tree_cfg.get("cost"):
            raise TreeError("a static tree has no node scores to size by cost: give `cost` to "
                            "a dynamic tree (depth, top_k, total_tokens)")
        return TreeTopology.from_choices(tree_cfg["choices"])
    if tree_cfg.get("policy") == "ddtree":
        return DDTree.from_config(tree_cfg)
    if "total_tokens" in tree_cfg:
        return DynamicTree.from_config(tree_cfg)
    raise TreeError(f"tree config {dict(tree_cfg)} has neither `choices` (a static tree) nor "
                    "`depth`, `top_k` and `total_tokens` (a dynamic tree)")


def proposes_chains(drafter_cfg: Mapping, tree_cfg: Mapping) -> bool:
    """Whether the drafter proposes chains only: one drafter filling a static topology that
    is a chain (a combinator's merged trees may branch, dynamic trees do)."""
    if drafter_cfg["name"] in COMBINATORS or "choices" not in tree_cfg:
        return False
    topology = TreeTopology.from_choices(tree_cfg["choices"])
    return all(len(topology.children(node)) <= 1 for node in range(topology.size))


def check_rule_fits(rule: RuleConfig, drafter_cfg: Mapping, tree_cfg: Mapping) -> None:
    """Refuse, before anything loads, an acceptance rule that verifies chains only (block)
    for a drafter whose trees may branch: it would stop the run at the first tree that does
    (and pass unnoticed while the drafts happen to be chains)."""
    name, _ = rule_parts(rule)
    if name in RULES and RULES[name].chains_only and not proposes_chains(drafter_cfg, tree_cfg):
        raise ValueError(f"the {name!r} rule verifies chains only, but drafter "
                         f"{drafter_cfg['name']!r} on tree {tree_cfg.get('name')!r} may propose "
                         "trees that branch: give it a chain tree (chain1..chain8) or use the "
                         "'sampling' rule")
