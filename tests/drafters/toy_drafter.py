"""A toy model-free drafter, added the way docs/extending.md says a new drafter is: this
module, its YAML (conf/drafter/toy.yaml beside it), a test file (test_toy_drafter.py) and one
registry entry (the test's DrafterEntry in drafters.DRAFTERS). It lives in the test suite
only.

It bets that the context repeats itself: its draft is what followed the latest earlier
occurrence of the root token, as a chain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from drafters.base import StatelessDrafter
from drafters.config import typed_config
from drafters.trees.dynamic import DynamicTree
from verify.protocol import DraftContext
from verify.runtime.model import Target
from verify.tree import TokenTree, TreeTopology


@dataclass
class ToyConfig:
    """conf/drafter/toy.yaml, typed: the only defaults of these keys."""

    name: str = "toy"
    max_depth: int = 4  # tokens copied per draft, at most


class RepeatDrafter(StatelessDrafter):
    """Drafts up to `depth` tokens that followed the root's latest earlier occurrence in the
    context, as a chain; the root alone when the root token is new."""

    def __init__(self, depth: int):
        self.depth = depth

    def propose(self, ctx: DraftContext) -> TokenTree:
        tokens = ctx.tokens.tolist()
        root = tokens[-1]
        earlier = [i for i, token in enumerate(tokens[:-1]) if token == root]
        copied = tokens[earlier[-1] + 1:][:self.depth] if earlier else []
        return TokenTree([root, *copied], list(range(-1, len(copied))))


def from_config(cfg: Mapping, tree: TreeTopology | DynamicTree, target: Target) -> RepeatDrafter:
    """The registry's builder: the YAML's keys; of the tree, its depth (a chain fits any
    tree); no model."""
    config: ToyConfig = typed_config(ToyConfig, cfg, "toy")
    return RepeatDrafter(min(config.max_depth, tree.depth))
