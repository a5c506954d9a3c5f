"""A drafter made of drafters: per step, pick one member's tree or merge them all.

SuffixDecoding pairs its model-free trees with a model drafter and lets the suffix match's
score decide, per step, which one proposes: a confident match is nearly free and long, and
the model covers the rest. Two policies:

- pick: members propose in order; the first whose tree expects at least `threshold` accepted
  tokens (the sum of its node scores) is taken, and the ones after it never run (a skipped
  model drafter costs nothing). The last member is taken whenever none before it qualified.
- merge: every member proposes; the trees are merged into one trie (shared prefixes once), a
  node scored by the best score any member gave its path, and cut to the `budget` best nodes
  (parents first), then to the tree policy's measured cost if it has one.

Exactness: a picked tree goes to the verifier as its member made it. A merged tree carries no
draft probabilities: its children are one-hot proposals, exact for greedy and sampled decoding
whichever member chose them (see verify.tree.TokenTree.keep).

A member that skips steps still sees every target feature: rows of skipped steps are kept and
handed over, in order, the next time it proposes (EAGLE catches up on all of them).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from drafters.config import typed_config
from drafters.trees.cost import cut_to_cost, ranked_nodes
from drafters.trees.dynamic import DynamicTree
from verify.accept import Acceptance
from verify.predictions import TargetPredictions
from verify.protocol import DraftContext, Drafter, ProposalCounts, Resettable
from verify.runtime.model import Target
from verify.tree import TokenTree, TreeBuilder, TreeError

POLICIES = ("pick", "merge")
DRAFTER_CONF = Path(__file__).resolve().parents[1] / "conf" / "drafter"


@dataclass
class HybridConfig:
    """conf/drafter/hybrid.yaml, typed: the only defaults of these keys."""

    name: str = "hybrid"
    # each a conf/drafter name, or {name: ..., <its keys>..., tree: {<tree keys>}} overriding it
    # suffix first (free to draft), then an EAGLE draft on a small tree of its own
    members: list = field(default_factory=lambda: [
        {"name": "suffix"},
        {"name": "eagle", "checkpoint": None, "tree": {"depth": 2, "top_k": 2, "total_tokens": 2}},
    ])
    policy: str = "pick"
    threshold: float = 1.0  # pick: expected accepted tokens a member's tree needs
    budget: int | None = None  # merge: draft nodes kept; None: the tree's total_tokens


class _Member:
    """A member drafter, its name, and the target features it has not seen yet."""

    def __init__(self, name: str, drafter: Drafter, columns: torch.Tensor | None):
        self.name, self.drafter, self.columns = name, drafter, columns
        self.pending: list[torch.Tensor] = []
        self.tree: TokenTree | None = None  # what it proposed this step, if it ran

    def context(self, ctx: DraftContext) -> DraftContext:
        """ctx with this member's feature columns of every step since it last proposed."""
        if self.columns is None:
            return replace(ctx, features=None)
        rows = torch.cat(self.pending) if self.pending else None
        self.pending = []
        return replace(ctx, features=rows)

    def fork(self) -> _Member:
        return _Member(self.name, self.drafter.fork(), self.columns)


class HybridDrafter(Resettable, ProposalCounts):
    """Combines member drafters by `policy` (see the module docstring)."""

    def __init__(self, members: Sequence[tuple[str, Drafter]], tree: DynamicTree | None,
                 config: HybridConfig = HybridConfig()):
        if len(members) < 2:
            raise ValueError(f"a hybrid drafter needs at least two members, got {len(members)}")
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {config.policy!r}")
        if math.isnan(config.threshold):  # every comparison false: only the last would draft
            raise ValueError("drafter.threshold must be a number of expected accepted tokens, "
                             "got nan")
        self.name, self.config, self.tree = config.name, config, tree
        self.feature_layers = _union(drafter.feature_layers for _, drafter in members)
        # the verified tree's predictions, as many as the member asking most needs
        self.target_top_k = max(drafter.target_top_k for _, drafter in members)
        self.members = [_Member(name, drafter, None) for name, drafter in members]
        self.proposed: Counter = Counter()  # member name (or "merged") -> steps, a running count

    def set_hidden_size(self, hidden: int) -> None:
        """Which of the union's F * hidden feature columns each member reads, in its own
        layer order."""
        for member in self.members:
            blocks = [self.feature_layers.index(layer) for layer in member.drafter.feature_layers]
            if blocks:
                member.columns = torch.cat([torch.arange(b * hidden, (b + 1) * hidden)
                                            for b in blocks])

    def begin(self, prompt: torch.Tensor) -> None:
        for member in self.members:
            member.drafter.begin(prompt)
            member.pending = []

    def propose(self, ctx: DraftContext) -> TokenTree:
        self._collect(ctx.features)
        for member in self.members:
            member.tree = None
        if self.config.policy == "pick":
            return self._pick(ctx)
        return self._merge(ctx)

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Each member that proposed learns the accepted tokens on its own tree and, if it asks
        for them, the target's top-k at its own nodes (`_predictions_on`)."""
        for member in self.members:
            if member.tree is None:
                continue
            own = acceptance if member.tree is tree else _follow(member.tree, tree, acceptance)
            predictions = _predictions_on(member.tree, tree, acceptance.predictions,
                                          member.drafter.target_top_k)
            member.drafter.update(member.tree, replace(own, predictions=predictions))

    def fork(self) -> HybridDrafter:
        twin = HybridDrafter([(m.name, m.drafter) for m in self.members], self.tree,
                             self.config)
        twin.members = [member.fork() for member in self.members]
        twin.proposed = self.proposed  # one running count for the whole batch
        return twin

    def forget(self) -> None:
        """Forget every member's memory of earlier requests (drafters that have one)."""
        for member in self.members:
            if isinstance(member.drafter, Resettable):
                member.drafter.forget()

    def _collect(self, features: torch.Tensor | None) -> None:
        if features is None:
            return
        for member in self.members:
            if member.columns is not None:
                member.pending.append(features[:, member.columns.to(features.device)])

    def _run(self, member: _Member, ctx: DraftContext) -> TokenTree:
        member.tree = member.drafter.propose(member.context(ctx))
        return member.tree

    def _pick(self, ctx: DraftContext) -> TokenTree:
        for member in self.members:
            tree = self._run(member, ctx)
            last = member is self.members[-1]
            if last or _expected(tree) >= self.config.threshold:
                self.proposed[member.name] += 1
                return tree
        raise AssertionError("unreachable: the last member always proposes")

    def _merge(self, ctx: DraftContext) -> TokenTree:
        trees = [self._run(member, ctx) for member in self.members]
        budget = self.config.budget or (self.tree.total_tokens if self.tree else None)
        merged = merge_trees(trees, budget)
        if self.tree is not None and self.tree.cost is not None:
            merged = cut_to_cost(merged, self.tree.cost)
        self.proposed["merged"] += 1
        return merged


def merge_trees(trees: Sequence[TokenTree], budget: int | None) -> TokenTree:
    """One trie of the trees' token paths (all rooted at the same token), each node scored by
    the best score a tree gives its path (a tree without scores counts as 0), cut to the
    `budget` best nodes (ties: the earlier tree's node first); no draft probabilities, so no
    node is sampled: the merged children of a node come from several drafters' draws and
    choices, which exact sampling takes as one-hot proposals (exact whatever was chosen)."""
    roots = {int(tree.tokens[0]) for tree in trees}
    if len(roots) != 1:
        raise TreeError(f"merged trees must share their root, got roots {sorted(roots)}")
    builder, best = TreeBuilder(roots.pop()), [1.0]
    for tree in trees:
        placed = [0]  # tree node -> merged node
        for i in range(1, len(tree)):
            node = builder.child(placed[int(tree.parents[i])], int(tree.tokens[i]))
            placed.append(node)
            score = 0.0 if tree.scores is None else float(tree.scores[i])
            if node == len(best):  # child() added it
                best.append(score)
            best[node] = max(best[node], score)
    built = builder.build()
    merged = TokenTree(built.tokens, built.parents, scores=torch.tensor(best))
    if budget is None or len(merged) - 1 <= budget:
        return merged
    return merged.keep(sorted([0, *ranked_nodes(merged.scores)[:budget]]))


def _expected(tree: TokenTree) -> float:
    """Expected accepted tokens of a member's tree: its scores' sum, or its size without
    scores (a drafter that gives none is trusted whenever it drafts)."""
    if tree.scores is None:
        return float(len(tree) - 1)
    return float(tree.scores[1:].sum())


def _follow(own: TokenTree, verified: TokenTree, acceptance: Acceptance) -> Acceptance:
    """The accepted tokens as a path of `own` (as far as it has them), and the next token."""
    tokens = [int(verified.tokens[n]) for n in acceptance.path[1:]] + [acceptance.bonus]
    path = [0]
    for token in tokens:
        child = [c for c in own.children(path[-1]) if int(own.tokens[c]) == token]
        if not child:
            return Acceptance(path, token)
        path.append(child[0])
    return Acceptance(path[:-1], tokens[-1])  # the bonus was drafted too: stop before it


def _predictions_on(own: TokenTree, verified: TokenTree,
                    predictions: TargetPredictions | None, k: int) -> TargetPredictions | None:
    """The first `k` of the target's predictions at each node of a member's `own` tree (None
    when it asks for none): those of the verified node with the same token path. A node whose
    path the verified (merged or other member's) tree lacks was not verified: its row says
    so in `verified` (verify.predictions.TargetPredictions)."""
    if predictions is None or k == 0:
        return None
    return predictions.at(range(len(own)) if own is verified else _same_nodes(own, verified), k)


def _same_nodes(own: TokenTree, verified: TokenTree) -> list[int | None]:
    """For each node of `own`, the node of `verified` with the same token path (None: none)."""
    nodes: list[int | None] = [0]  # the roots are the same token
    for i in range(1, len(own)):
        parent, token = nodes[int(own.parents[i])], int(own.tokens[i])
        match = [] if parent is None else [c for c in verified.children(parent)
                                           if int(verified.tokens[c]) == token]
        nodes.append(match[0] if match else None)
    return nodes


def _union(layer_sets) -> tuple[int, ...]:
    union: list[int] = []
    for layers in layer_sets:
        union.extend(layer for layer in layers if layer not in union)
    return tuple(union)


def hybrid_config(cfg: Mapping) -> HybridConfig:
    """conf/drafter/hybrid.yaml typed (drafters.config.typed_config)."""
    return typed_config(HybridConfig, cfg, "hybrid")


def member_configs(cfg: HybridConfig) -> list[tuple[dict, dict]]:
    """Each member's (drafter config, tree overrides): conf/drafter/<name>.yaml with the
    member's keys over it."""
    resolved = []
    for member in cfg.members:
        member = {"name": member} if isinstance(member, str) else dict(member)
        if not isinstance(member.get("name"), str):
            raise ValueError(f"hybrid member {member} has no name: give each member the "
                             "conf/drafter name it builds ({name: suffix, ...})")
        path = DRAFTER_CONF / f"{member['name']}.yaml"
        if not path.is_file() or member["name"] == "hybrid":
            known = sorted(p.stem for p in DRAFTER_CONF.glob("*.yaml") if p.stem != "hybrid")
            raise ValueError(f"unknown hybrid member {member['name']!r}; known: {known}")
        tree = dict(member.pop("tree", None) or {})
        drafter = OmegaConf.to_container(OmegaConf.merge(OmegaConf.load(path), member))
        resolved.append((drafter, tree))
    return resolved


def from_config(cfg: Mapping, tree_cfg: Mapping, policy, target: Target, build) -> HybridDrafter:
    """conf/drafter/hybrid.yaml over the tree `tree_cfg` (its policy built: `policy`).
    `build(drafter_cfg, tree_cfg, target)` (drafters.build_drafter) builds each member on the
    tree config with the member's tree overrides."""
    config = hybrid_config(cfg)
    members = [(drafter["name"], build(drafter, {**tree_cfg, **tree_overrides}, target))
               for drafter, tree_overrides in member_configs(config)]
    hybrid = HybridDrafter(members, policy if isinstance(policy, DynamicTree) else None, config)
    hybrid.set_hidden_size(target.model.config.hidden_size)
    return hybrid
