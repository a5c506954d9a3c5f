"""Trees from a block drafter: one draft forward gives every depth's distribution at once.

A block drafter (DFlash, PARD) reads the context once and returns, for the D positions after
the root, per-position *marginals*: row d is its distribution of the token at depth d + 1 given
the context only, not given the tokens drafted at depths 1..d. Any tree policy can be filled
from them, because a node's children at depth d + 1 are proposed from row d whatever their
parent holds:

- a static topology (`choices`; a chain is the paper's setting): each node's children are the
  top-k of row depth(node) (greedy) or successive draws without replacement from its warped row
  (sampling), recorded as the node's draft distribution. That is exact under recursive
  rejection sampling: the row is the distribution the children really came from, fixed before
  they were drawn; that it ignores the parent's token costs acceptance, never exactness;
- EAGLE-2's dynamic tree (`depth`, `top_k`, `total_tokens`): expansion reads row d for every
  frontier node at depth d; top-k children, deterministic;
- DDTree (`policy: ddtree`, `total_tokens`): best-first over the marginals, the N paths with
  the highest product of marginals (drafters.trees.ddtree); chosen, so one-hot proposals.

Shapes: `marginals` is (D, V) draft logits over the target's vocabulary (-inf for tokens the
draft cannot propose), row d for depth d + 1.

Both block drafters feed the positions to predict as MASK, whose input is a learned mask
embedding (`embed_with_masks`), not a row of the token table; a graph (the OpenVINO drafts)
feeds it as one more row of the table (`table_with_mask`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from drafters.trees import TreePolicy
from drafters.trees.confidence import ConfidenceChain
from drafters.trees.ddtree import DDTree
from drafters.trees.dynamic import DynamicTree, draft_log_probs
from drafters.trees.steps import add_children, run_steps
from verify.accept import Acceptance
from verify.protocol import DraftContext
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeBuilder, TreeError, TreeTopology

MASK = -1  # a block token id meaning "to predict": its input is the learned mask embedding


def embed_with_masks(embed: nn.Module, tokens: torch.Tensor, mask_embedding: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, n) long ids, MASK where to predict -> (B, n, H) inputs: `embed`'s rows (cast to
    `dtype` when given), the learned `mask_embedding` (H,) at every MASK."""
    h = embed(tokens.clamp_min(0))
    if dtype is not None:
        h = h.to(dtype)
    return torch.where((tokens == MASK)[..., None], mask_embedding.to(h.dtype), h)


def table_with_mask(table: torch.Tensor, mask_embedding: torch.Tensor) -> torch.Tensor:
    """The (V, H) token table with the learned mask embedding as row V: a graph (the OpenVINO
    drafts) feeds MASK as id V = len(table) and gathers its input like any token's."""
    return torch.cat([table, mask_embedding.detach().to(table)[None]])


def check_block_tree(tree: TreePolicy, max_depth: int, drafter: str, limit: str) -> None:
    """Refuse, at construction, a tree deeper than the block: `max_depth` is the deepest
    position the block drafts, `limit` the setting it comes from, as the message names it
    (DFlash: "drafter.block_size - 1", PARD: "drafter.block_size")."""
    # a DDTree's or a confidence chain's depth may be null: as deep as the block
    depth = tree.depth or max_depth if isinstance(tree, DDTree | ConfidenceChain) else tree.depth
    if depth > max_depth:
        raise TreeError(f"tree depth {depth} exceeds what {drafter} can fill: its block "
                        f"drafts {max_depth} positions ({limit})")


def tree_from_block(tree: TreePolicy, root: int, marginals: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator | None = None
                    ) -> TokenTree:
    """The tree `tree` describes below `root`, filled from (D, V) marginal draft logits."""
    if marginals.dim() != 2:
        raise ValueError(f"marginals must be (D, V), got {tuple(marginals.shape)}")
    if isinstance(tree, DDTree):
        return tree.grow(root, draft_log_probs(marginals, params))
    if isinstance(tree, DynamicTree):
        return _dynamic(tree, root, draft_log_probs(marginals, params))
    return fill_from_marginals(tree, root, marginals, params, generator)


def fill_from_marginals(topology: TreeTopology, root: int, marginals: torch.Tensor,
                        params: SamplingParams, generator: torch.Generator | None) -> TokenTree:
    """A static topology filled from (D, V) marginal draft logits, node by node in order: node
    u's children from row depth(u) (top-k, or drawn without replacement when sampling)."""
    builder = TreeBuilder(root)
    placed = {0: 0}  # topology node -> tree node
    for node in range(topology.size):
        depth = builder.depth(placed[node]) if node in placed else None
        if depth is None or depth >= marginals.shape[0] or not topology.children(node):
            continue
        add_children(builder, topology, placed, node, marginals[depth], params, generator)
    return builder.build()


def _dynamic(tree: DynamicTree, root: int, log_probs: torch.Tensor) -> TokenTree:
    """EAGLE-2's search and rerank with every expansion answered from the marginals."""
    def expand(candidates: TreeBuilder, nodes: list[int]) -> torch.Tensor:
        return log_probs[[candidates.depth(n) for n in nodes]]

    steps = tree.search_steps(root, log_probs[0])
    candidates = run_steps(steps, lambda request: expand(*request))
    return candidates.build(tree.rerank(candidates))


class BlockDrafter(ABC):
    """The Drafter protocol for a block drafter holding one sequence's draft state (a batch
    forks one per row): each proposal is one forward's marginals (`block_marginals`, which
    counts it in `forwards`) turned into `tree` by `tree_from_block`. A subclass writes
    `begin`, `block_marginals` and `draft_cache_bytes`; `max_depth` is the deepest tree its
    block fills and `limit` the setting it comes from (check_block_tree), a deeper `tree`
    refused at construction."""

    feature_layers: tuple[int, ...] = ()
    target_top_k = 0

    def __init__(self, draft, tree: TreePolicy, name: str, max_depth: int, limit: str):
        check_block_tree(tree, max_depth, name, limit)
        self.draft, self.tree, self.name = draft.eval(), tree, name
        self.forwards = 0

    def fork(self) -> BlockDrafter:
        """A drafter for another row: the same draft and tree, its own state."""
        return type(self)(self.draft, self.tree, self.name)

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Nothing to do: the next context brings what the target accepted."""

    @property
    def draft_forwards(self) -> int:
        return self.forwards

    @abstractmethod
    def begin(self, prompt: torch.Tensor) -> None:
        """Forget the previous sequence's draft state."""

    @abstractmethod
    def block_marginals(self, ctx: DraftContext) -> torch.Tensor:
        """(D, V) float CPU draft logits over the target's vocabulary after ctx.tokens[-1],
        row d for depth d + 1, from one draft forward."""

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> TokenTree:
        return tree_from_block(self.tree, int(ctx.tokens[-1]), self.block_marginals(ctx),
                               ctx.params, ctx.generator)
