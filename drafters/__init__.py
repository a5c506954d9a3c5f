"""Drafters: each proposes a TokenTree for the shared verifier (see verify.protocol).

DRAFTERS is the one table of them: per drafter its builder, its OpenVINO form and its traits
(a block drafter, draws its children, draws siblings i.i.d.), from which every check here
reads. A new drafter is one module here with a `from_config(cfg, tree, target)` builder, one
DrafterEntry in DRAFTERS, one YAML in conf/drafter/, and one row in
tests/drafters/test_drafter_table.py (docs/extending.md; tests/drafters/toy_drafter.py follows
the recipe). A model-free drafter subclasses drafters.base.StatelessDrafter and writes
`propose` (or StatelessBatchDrafter and `propose_batch`); one running a model over the tree with
a draft KV cache subclasses drafters.engine.EngineDrafter and writes its catch-up and per-level
forward; a block drafter (one forward gives every depth's distribution) subclasses
drafters.block.BlockDrafter and writes `begin`, `block_marginals` and `draft_cache_bytes`.
The drafter owns its tree policy (drafters.trees): a static TreeTopology, EAGLE-2's DynamicTree
or, for a block drafter only, a DDTree; a drafter that cannot grow a dynamic tree refuses one
with a TreeError. A combinator (COMBINATORS: hybrid) builds its member drafters through
`build_drafter` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from drafters import (
    dflash,
    draft_model,
    dspark,
    eagle,
    hybrid,
    medusa,
    pard,
    prompt_lookup,
    recycling,
    suffix,
)
from drafters.openvino_dflash import OpenVINODFlashDrafter, OpenVINODSparkDrafter
from drafters.paged_drafts import (
    OpenVINOMedusaDrafter,
    PagedDraftModelDrafter,
    PagedEagleDrafter,
    PagedPardDrafter,
)
from drafters.trees import TreePolicy, is_chain, is_static, tree_policy
from drafters.trees.confidence import ConfidenceChain
from drafters.trees.cost import measured_cost
from drafters.trees.ddtree import DDTree
from verify.protocol import Drafter
from verify.rules import RULES, RuleConfig, rule_parts
from verify.runtime.model import Target
from verify.runtime.step import TargetStep
from verify.tree import TreeError

DrafterBuilder = Callable[[Mapping, TreePolicy, Target], Drafter]
DRAFT_STEPS = ("torch", "openvino")  # drafter.step values; null: the target step's own


@dataclass(frozen=True)
class DrafterEntry:
    """One drafter: how it is built and what it can do."""

    build: DrafterBuilder
    # the same drafter with its draft's forwards on the target step's OpenVINO kernels
    # (drafter.step=openvino), made from what `build` made; None: a drafter without a model,
    # whose work runs in PyTorch beside any step
    openvino: Callable[[Drafter, TargetStep], Drafter] | None = None
    # one forward gives every depth's distribution (drafters.block): it can fill a DDTree
    block: bool = False
    # sampling on a static tree, it draws a node's children from a draft distribution it
    # records (TokenTree.draft_probs); the others choose theirs (n-gram matches, a suffix trie,
    # recycled successors), and so does every drafter on a dynamic tree or a DDTree (top-k by
    # score): their trees are one-hot proposals
    draws: bool = False
    iid: bool = False  # it can draw a node's siblings i.i.d. (its `iid_siblings`)
    # a confidence head schedules how much of a chain to verify (tree policy: confidence)
    schedules: bool = False


# eagle and eagle3: one drafter (drafters.eagle), two shipped configs
EAGLE = DrafterEntry(eagle.from_config, PagedEagleDrafter.from_torch, draws=True)
DRAFTERS: dict[str, DrafterEntry] = {
    "dflash": DrafterEntry(dflash.from_config, OpenVINODFlashDrafter.from_torch, block=True,
                           draws=True),
    "dspark": DrafterEntry(dspark.from_config, OpenVINODSparkDrafter.from_torch, block=True,
                           draws=True, schedules=True),
    "draft_model": DrafterEntry(draft_model.from_config, PagedDraftModelDrafter.from_torch,
                                draws=True, iid=True),
    "eagle": EAGLE,
    "eagle3": EAGLE,
    "medusa": DrafterEntry(medusa.from_config, OpenVINOMedusaDrafter.from_torch, draws=True),
    "pard": DrafterEntry(pard.from_config, PagedPardDrafter.from_torch, block=True, draws=True),
    "prompt_lookup": DrafterEntry(prompt_lookup.from_config),
    "recycling": DrafterEntry(recycling.from_config),
    "suffix": DrafterEntry(suffix.from_config),
}
# Combinators build their members through build_drafter, from the raw tree config.
COMBINATORS = {"hybrid": hybrid.from_config}


def drafters_that(trait: str) -> list[str]:
    """The registered drafters whose DrafterEntry has `trait` ("block", "draws", "iid")."""
    return [name for name, entry in DRAFTERS.items() if getattr(entry, trait)]


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
    entry, policy = DRAFTERS[name], tree_policy(tree_cfg)
    if isinstance(policy, DDTree) and not entry.block:
        raise TreeError(f"tree {tree_cfg.get('name')!r} is a DDTree, built from a block "
                        f"drafter's per-position marginals: drafter {name!r} has none (block "
                        f"drafters: {drafters_that('block')})")
    if isinstance(policy, ConfidenceChain) and not entry.schedules:
        raise TreeError(f"tree {tree_cfg.get('name')!r} is cut by a confidence head's "
                        f"acceptance estimates: drafter {name!r} has none (drafters with one: "
                        f"{drafters_that('schedules')})")
    openvino = (entry.openvino is not None
                and draft_step(drafter_cfg.get("step"), target.step, name) == "openvino")
    drafter = entry.build(drafter_cfg, policy, target)
    return entry.openvino(drafter, target.step) if openvino else drafter


def draft_step(requested: str | None, step: TargetStep, name: str) -> str:
    """Where drafter `name`'s draft forwards run: `requested` (drafter.step), or, when null,
    where the target's `step` runs drafts by default (the first of its `draft_steps`)."""
    if requested is None:
        return step.draft_steps[0]
    if requested not in DRAFT_STEPS:
        raise ValueError(f"drafter.step must be one of {DRAFT_STEPS} or null, got {requested!r}")
    if requested not in step.draft_steps:
        raise ValueError(f"drafter.step={requested} runs {name}'s draft on the target step's "
                         "OpenVINO kernels, precision and threads: set target.step=openvino "
                         "too (or drafter.step=torch)")
    return requested


def proposes_chains(drafter_cfg: Mapping, tree_cfg: Mapping) -> bool:
    """Whether the drafter proposes chains only: one drafter filling a static topology that
    is a chain (a combinator's merged trees may branch, dynamic trees do)."""
    return drafter_cfg["name"] not in COMBINATORS and is_chain(tree_cfg)


@dataclass(frozen=True)
class TreeTraits:
    """What every tree a drafter config proposes is, known from its config alone."""

    chains: bool  # no node has more than one child
    drawn: bool  # sampling: children drawn from a recorded draft distribution
    iid: bool  # and a node's siblings drawn i.i.d.


def tree_traits(drafter_cfg: Mapping, tree_cfg: Mapping) -> TreeTraits:
    """The traits of the trees drafter `drafter_cfg` proposes on tree `tree_cfg`: its
    DrafterEntry's, drawn on a static tree only (DrafterEntry.draws). A hybrid that picks a
    member's tree as it is has the traits all its members share; one that merges them
    proposes one-hot trees."""
    name = drafter_cfg["name"]
    if name in COMBINATORS:
        config = hybrid.hybrid_config(drafter_cfg)
        members = [tree_traits(member, {**tree_cfg, **overrides})
                   for member, overrides in hybrid.member_configs(config)]
        picks = config.policy == "pick"
        return TreeTraits(chains=False, drawn=picks and all(m.drawn for m in members),
                          iid=picks and all(m.iid for m in members))
    entry = DRAFTERS.get(name)
    drawn = entry is not None and entry.draws and is_static(tree_cfg)
    iid = drawn and entry.iid and bool(drafter_cfg.get("iid_siblings", False))
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
        drawing = ", ".join(drafters_that("draws"))
        return (f"the {name!r} rule verifies sampled trees, but {drafter} chooses its "
                "children (no draft probabilities): use 'sampling', which is optimal for "
                f"chosen drafts, or a drafter that draws them ({drawing} on a static tree)")
    if needs.needs_iid and not traits.iid:
        return (f"the {name!r} rule selects among siblings drawn i.i.d., but {drafter} "
                "draws them without replacement: set drafter.iid_siblings=true (a "
                f"{' or '.join(drafters_that('iid'))} on a static tree), or use 'sampling' or "
                "'traversal'")
    return None


def check_rule_fits(rule: RuleConfig, drafter_cfg: Mapping, tree_cfg: Mapping) -> None:
    """Refuse, before anything loads, an acceptance rule that cannot verify the drafter's
    trees (`rule_refusal`): it would stop the run at the first tree it refuses (and pass
    unnoticed while the drafts happen to fit)."""
    refusal = rule_refusal(rule, drafter_cfg, tree_cfg)
    if refusal is not None:
        raise ValueError(refusal)
