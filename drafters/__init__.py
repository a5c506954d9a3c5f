"""Drafters: each proposes a TokenTree for the shared verifier (see verify.protocol).

A new drafter is one module here with a `from_config(cfg, tree, target)` builder, one entry
in DRAFTERS, one YAML in conf/drafter/, and one row in tests/drafters/test_drafter_table.py.
A model-free drafter subclasses drafters.base.StatelessDrafter and writes `propose` (or
StatelessBatchDrafter and `propose_batch`); one running a model over the tree with a draft KV
cache subclasses drafters.engine.EngineDrafter and writes its catch-up and per-level forward;
a block drafter (one forward gives every depth's distribution) subclasses
drafters.block.BlockDrafter, writes `begin`, `block_marginals` and `draft_cache_bytes`, and joins
BLOCK_DRAFTERS.
tests/drafters/toy_drafter.py follows the recipe.
The drafter owns its tree policy (drafters.trees.TreePolicy): `tree` is a static TreeTopology
(conf/tree with `choices`), EAGLE-2's DynamicTree (conf/tree with `depth`, `top_k`,
`total_tokens`) or, for a block drafter only, a DDTree (`policy: ddtree`); a drafter that
cannot grow a dynamic tree refuses one with a TreeError. A combinator (COMBINATORS: hybrid)
builds its member drafters through `build_drafter` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
from drafters.paged_drafts import draft_step, on_openvino
from drafters.trees import TreePolicy, is_chain, is_static, tree_policy
from drafters.trees.cost import measured_cost
from drafters.trees.ddtree import DDTree
from verify.protocol import Drafter
from verify.rules import RULES, RuleConfig, rule_parts
from verify.target.model import Target
from verify.tree import TreeError

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
# Drafters that run a draft model: `drafter.step` says whether its forwards run in PyTorch or on
# the OpenVINO target step's kernels (drafters.paged_drafts.on_openvino)
MODEL_DRAFTERS = ("dflash", "draft_model", "eagle", "eagle3", "medusa", "pard")
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
    openvino = (name in MODEL_DRAFTERS
                and draft_step(drafter_cfg.get("step"), target, name) == "openvino")
    drafter = DRAFTERS[name](drafter_cfg, policy, target)
    return on_openvino(drafter, target.step) if openvino else drafter


def proposes_chains(drafter_cfg: Mapping, tree_cfg: Mapping) -> bool:
    """Whether the drafter proposes chains only: one drafter filling a static topology that
    is a chain (a combinator's merged trees may branch, dynamic trees do)."""
    return drafter_cfg["name"] not in COMBINATORS and is_chain(tree_cfg)


# Drafters that, when sampling on a static tree, draw a node's children from a draft
# distribution they record (TokenTree.draft_probs). The others choose theirs (n-gram matches,
# a suffix trie, recycled successors), and so does every drafter on a dynamic tree or a DDTree
# (top-k by score): their trees are one-hot proposals.
DRAWING_DRAFTERS = ("dflash", "draft_model", "eagle", "eagle3", "medusa", "pard")
# Drafters that can draw a node's siblings i.i.d. (with replacement): their `iid_siblings`
IID_DRAFTERS = ("draft_model",)


@dataclass(frozen=True)
class TreeTraits:
    """What every tree a drafter config proposes is, known from its config alone."""

    chains: bool  # no node has more than one child
    drawn: bool  # sampling: children drawn from a recorded draft distribution
    iid: bool  # and a node's siblings drawn i.i.d.


def tree_traits(drafter_cfg: Mapping, tree_cfg: Mapping) -> TreeTraits:
    """The traits of the trees drafter `drafter_cfg` proposes on tree `tree_cfg` (see
    DRAWING_DRAFTERS). A hybrid that picks a member's tree as it is has the traits all its
    members share; one that merges them proposes one-hot trees."""
    name = drafter_cfg["name"]
    if name in COMBINATORS:
        config = hybrid.hybrid_config(drafter_cfg)
        members = [tree_traits(member, {**tree_cfg, **overrides})
                   for member, overrides in hybrid.member_configs(config)]
        picks = config.policy == "pick"
        return TreeTraits(chains=False, drawn=picks and all(m.drawn for m in members),
                          iid=picks and all(m.iid for m in members))
    drawn = name in DRAWING_DRAFTERS and is_static(tree_cfg)
    iid = drawn and name in IID_DRAFTERS and bool(drafter_cfg.get("iid_siblings", False))
    return TreeTraits(chains=proposes_chains(drafter_cfg, tree_cfg), drawn=drawn, iid=iid)


def rule_refusal(rule: RuleConfig, drafter_cfg: Mapping, tree_cfg: Mapping) -> str | None:
    """Why the acceptance rule `rule` cannot verify the trees drafter `drafter_cfg` proposes
    on tree `tree_cfg` (what the rule declares it needs, against `tree_traits`), or None
    when it can. The one place rules and drafters are matched: the bench and the
    correctness evaluation ask it before anything loads, the rules check each tree again."""
    name, _ = rule_parts(rule)
    if name not in RULES:
        return None
    needs, traits = RULES[name], tree_traits(drafter_cfg, tree_cfg)
    drafter = f"drafter {drafter_cfg['name']!r} on tree {tree_cfg.get('name')!r}"
    if needs.chains_only and not traits.chains:
        return (f"the {name!r} rule verifies chains only, but {drafter} may propose trees "
                "that branch: give it a chain tree (chain1..chain8) or use the 'sampling' rule")
    if needs.needs_draws and not traits.drawn:
        return (f"the {name!r} rule verifies sampled trees, but {drafter} chooses its "
                "children (no draft probabilities): use 'sampling', which is optimal for "
                f"chosen drafts, or a drafter that draws them ({', '.join(DRAWING_DRAFTERS)} "
                "on a static tree)")
    if needs.needs_iid and not traits.iid:
        return (f"the {name!r} rule selects among siblings drawn i.i.d., but {drafter} "
                "draws them without replacement: set drafter.iid_siblings=true (a "
                f"{' or '.join(IID_DRAFTERS)} on a static tree), or use 'sampling' or "
                "'traversal'")
    return None


def check_rule_fits(rule: RuleConfig, drafter_cfg: Mapping, tree_cfg: Mapping) -> None:
    """Refuse, before anything loads, an acceptance rule that cannot verify the drafter's
    trees (`rule_refusal`): it would stop the run at the first tree it refuses (and pass
    unnoticed while the drafts happen to fit)."""
    refusal = rule_refusal(rule, drafter_cfg, tree_cfg)
    if refusal is not None:
        raise ValueError(refusal)
