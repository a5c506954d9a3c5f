"""The toy drafter's twin that reads the verified tree, added by the same recipe: this module,
its YAML (conf/drafter/toy_echo.yaml beside it), its tests (test_toy_drafter.py, beside the
toy's) and one registry entry (the test's DrafterEntry in drafters.DRAFTERS). It lives in the
test suite only.

It declares `target_top_k = 1` and keeps, for every token of a tree it proposed, the target's
top-1 after that token's node (Acceptance.predictions): its draft is the chain of those
recorded predictions from the root, a bigram table the target itself wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from drafters.base import StatelessDrafter
from drafters.config import typed_config
from drafters.trees.dynamic import DynamicTree
from verify.accept import Acceptance
from verify.protocol import DraftContext
from verify.runtime.model import Target
from verify.tree import TokenTree, TreeTopology


@dataclass
class ToyEchoConfig:
    """conf/drafter/toy_echo.yaml, typed: the only defaults of these keys."""

    name: str = "toy_echo"
    max_depth: int = 4  # tokens chained per draft, at most


class EchoDrafter(StatelessDrafter):
    """Drafts up to `depth` tokens as a chain: after the root, the target's recorded top-1
    after it, then the one recorded after that token, and so on; the root alone for a token
    it has no record of. Its state is the record, per sequence (`begin`, `fork`)."""

    target_top_k = 1  # the top-1 is all it reads

    def __init__(self, depth: int):
        self.depth = depth
        self.next_token: dict[int, int] = {}  # token -> the target's latest top-1 after it

    def begin(self, prompt: torch.Tensor) -> None:
        self.next_token = {}

    def propose(self, ctx: DraftContext) -> TokenTree:
        root = token = int(ctx.tokens[-1])
        chain = []
        while len(chain) < self.depth and token in self.next_token:
            token = self.next_token[token]
            chain.append(token)
        return TokenTree([root, *chain], list(range(-1, len(chain))))

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Record the target's top-1 after every node: deeper nodes last, so the latest
        context wins."""
        best = acceptance.predictions.ids[:, 0].tolist()
        self.next_token.update(zip(tree.tokens.tolist(), best))

    def fork(self) -> EchoDrafter:
        """Another sequence's drafter: the same depth, its own (empty) record."""
        return EchoDrafter(self.depth)


def from_config(cfg: Mapping, tree: TreeTopology | DynamicTree, target: Target) -> EchoDrafter:
    """The registry's builder: the YAML's keys; of the tree, its depth (a chain fits any
    tree); no model."""
    config: ToyEchoConfig = typed_config(ToyEchoConfig, cfg, "toy_echo")
    return EchoDrafter(min(config.max_depth, tree.depth))
