"""Tree policies: which tree a drafter grows each step, read from a conf/tree mapping here alone.

A drafter owns its policy (drafters.build_drafter hands it `tree_policy(tree_cfg)`):

- a static TreeTopology (`choices`, verify.tree): the same shape every step, filled level by
  level (steps.py: a policy written as steps serves one row and B rows in lockstep alike);
- EAGLE-2's DynamicTree (`depth`, `top_k`, `total_tokens`; dynamic.py): the draft's confidence
  decides where the tree grows;
- DDTree (`policy: ddtree`, `total_tokens`; ddtree.py): best-first over a block drafter's
  per-position marginals, for block drafters only;
- ConfidenceChain (`policy: confidence`; confidence.py): a chain cut each step where DSpark's
  confidence head says verifying more stops paying, for drafters with a confidence head.

A dynamic tree or a DDTree may carry a `cost` (cost.py): each step keeps only the nodes that
pay for their verification on this machine. `cost: {measure: true}` is timed on the target's
step by `cost.measured_cost` before the policy is built.
"""

from __future__ import annotations

from collections.abc import Mapping

from drafters.trees.confidence import ConfidenceChain
from drafters.trees.cost import step_cost
from drafters.trees.ddtree import DDTree
from drafters.trees.dynamic import DynamicTree
from verify.tree import TreeError, TreeTopology

TreePolicy = TreeTopology | DynamicTree | DDTree | ConfidenceChain


def tree_policy(tree_cfg: Mapping) -> TreePolicy:
    """The policy a conf/tree mapping describes: a static topology for one with `choices`, a
    DDTree for one with `policy: ddtree` (`total_tokens`, optionally `depth` and `cost`), a
    DynamicTree for one with `depth`, `top_k` and `total_tokens` (optionally `cost`), a
    ConfidenceChain for one with `policy: confidence` (`cost` or `threshold`, `depth`).
    TreeError for a config of neither kind, or a cost on a static tree."""
    if is_static(tree_cfg):
        if tree_cfg.get("cost"):
            raise TreeError("a static tree has no node scores to size by cost: give `cost` to "
                            "a dynamic tree (depth, top_k, total_tokens)")
        return TreeTopology.from_choices(tree_cfg["choices"])
    if tree_cfg.get("policy") == "confidence":
        depth, threshold = tree_cfg.get("depth"), tree_cfg.get("threshold")
        return ConfidenceChain(None if depth is None else int(depth),
                               step_cost(tree_cfg.get("cost")),
                               None if threshold is None else float(threshold))
    if tree_cfg.get("policy") == "ddtree":
        depth = tree_cfg.get("depth")
        return DDTree(int(tree_cfg["total_tokens"]), None if depth is None else int(depth),
                      step_cost(tree_cfg.get("cost")))
    if "total_tokens" in tree_cfg:
        return DynamicTree(int(tree_cfg["depth"]), int(tree_cfg["top_k"]),
                           int(tree_cfg["total_tokens"]), step_cost(tree_cfg.get("cost")))
    raise TreeError(f"tree config {dict(tree_cfg)} has neither `choices` (a static tree) nor "
                    "`depth`, `top_k` and `total_tokens` (a dynamic tree)")


def is_static(tree_cfg: Mapping) -> bool:
    """Whether the config is a static topology, told from its keys before anything loads: the
    only trees whose children a drafter may draw (the other policies keep the top nodes by
    score, so their trees are one-hot proposals)."""
    return "choices" in tree_cfg


def is_chain(tree_cfg: Mapping) -> bool:
    """Whether the config is a static topology no node of which has more than one child."""
    if not is_static(tree_cfg):
        return False
    topology = TreeTopology.from_choices(tree_cfg["choices"])
    return all(len(topology.children(node)) <= 1 for node in range(topology.size))
