"""EAGLE-2's dynamic draft tree (Li et al. 2024) as a tree policy any autoregressive drafter uses.

A static tree spends the same nodes on every step; EAGLE-2 lets the draft model's confidence
decide where the tree grows. Each candidate's score is its cumulative draft log-probability
(the log of the product of the draft probabilities along its path), an estimate of how likely
the target is to accept the whole path.

- Expansion: round 1 proposes the root's top_k tokens. Each later round expands only the top_k
  candidates of the previous round by score (the frontier), each into its top_k children: one
  draft forward per round over at most top_k nodes, however many candidates pile up.
- Rerank: of all candidates, the `total_tokens` with the highest scores become the tree. A log-
  probability is <= 0, so a child never outscores its parent: the kept set is a tree.

The drafter supplies the draft model through `expand` (one tree level in its KV cache); this
module only chooses tokens, as SafeAILab/EAGLE's `topK_genrate` does.

Exactness. The children are chosen deterministically (top-k), so the tree carries no draft
probabilities (`draft_probs=None`), which the verifier's sampling rule treats as one-hot
proposals: exact for greedy and sampled decoding alike. Sampled children could not be kept
this way: recursive rejection sampling is exact only if a node's children are successive draws
without replacement from q. Pruning them by their sampled scores would make the kept set depend
on the values drawn (a low draw is dropped, a high one kept), so the children the verifier sees
are no longer distributed as q, and the residual (p - q)+ it samples from would be wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafters.trees.cost import StepCost, best_size
from drafters.trees.steps import Steps, run_steps
from verify.sampling import SamplingParams, warp
from verify.tree import TokenTree, TreeBuilder

# (candidates, nodes to expand) -> (len(nodes), V) draft log-probabilities of their children.
# The candidates are a scored verify.tree.TreeBuilder: every token the tree considered, its
# log_scores the cumulative draft log-probabilities, numbered round by round (a lower index is
# never deeper).
Expand = Callable[[TreeBuilder, list[int]], torch.Tensor]


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's tree policy: depth rounds of expansion, top_k children per expanded node,
    total_tokens draft nodes kept (root not counted). With a measured `cost`, each step keeps
    only the nodes that pay for their verification (drafters.trees.cost), and a round of
    expansion runs only while its best candidate's chance of acceptance times t(1) exceeds a
    draft forward's cost."""

    depth: int
    top_k: int
    total_tokens: int
    cost: StepCost | None = None

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicTree.{name} must be an integer >= 1, got {value!r}")

    def grow(self, root: int, root_logprobs: torch.Tensor, expand: Expand) -> TokenTree:
        """The draft tree below `root`, given the draft log-probabilities (V,) after it."""
        candidates = self.search(root, root_logprobs, expand)
        return candidates.build(self.rerank(candidates))

    def search(self, root: int, root_logprobs: torch.Tensor, expand: Expand) -> TreeBuilder:
        """Expansion phase: every candidate of `depth` rounds, calling `expand` once per round
        after the first, on that round's frontier (ascending indices, all of one depth)."""
        return run_steps(self.search_steps(root, root_logprobs),
                         lambda request: expand(*request))

    def search_steps(self, root: int, root_logprobs: torch.Tensor) -> Steps:
        """`search` as steps (drafters.trees.steps.run_steps): yields (candidates, frontier)
        once per round after the first, takes the frontier's (len(frontier), V)
        log-probabilities, returns the TreeBuilder.

        No more than `total_tokens` rounds run: a kept node needs all its ancestors kept, so no
        node deeper than `total_tokens` can be kept, and rounds past it would only cost draft
        forwards (a 2-node budget at depth 3 drafted 3 levels to keep 2)."""
        if root_logprobs.dim() != 1:
            raise ValueError(f"root_logprobs must be (V,), got {tuple(root_logprobs.shape)}")
        candidates = TreeBuilder(root, scored=True)
        level = self._add_children(candidates, [0], root_logprobs[None])
        for _ in range(1, min(self.depth, self.total_tokens)):
            frontier = self._frontier(candidates, level)
            if not frontier or not self._round_pays(candidates, frontier):
                break
            logprobs = yield candidates, frontier
            if logprobs.dim() != 2 or logprobs.shape[0] != len(frontier):
                raise ValueError(f"expand returned {tuple(logprobs.shape)} for "
                                 f"{len(frontier)} nodes; expected ({len(frontier)}, V)")
            level = self._add_children(candidates, frontier, logprobs)
        return candidates

    def rerank(self, candidates: TreeBuilder) -> list[int]:
        """The root and the `total_tokens` best candidates by score, ascending (parents first).

        Ties go to the lower index, i.e. the shallower node, then the earlier proposal; so a
        parent always ranks before a child that ties it (log-probability 0).
        """
        scores = torch.tensor(candidates.log_scores[1:], dtype=torch.float64)
        order = scores.sort(descending=True, stable=True).indices + 1
        kept, ranked = {0}, []
        for node in order.tolist():
            if len(ranked) == self.total_tokens:
                break
            # Only an `expand` returning positive "log-probabilities" could rank a child above
            # its parent; skipping such a child keeps the result a tree whatever the input.
            if candidates.parents[node] in kept:
                kept.add(node)
                ranked.append(node)
        if self.cost is not None:
            forwards = max(candidates.depth(n) for n in range(len(candidates)))
            worth = [math.exp(candidates.log_scores[n]) for n in ranked]
            ranked = ranked[:best_size(worth, self.cost, forwards)]
        return sorted([0, *ranked])

    def _round_pays(self, candidates: TreeBuilder, frontier: list[int]) -> bool:
        """Whether another draft forward can pay: its best candidate's chance of acceptance
        times a plain step's cost must exceed the forward's (always, without a cost)."""
        if self.cost is None:
            return True
        best = max(candidates.log_scores[n] for n in frontier)
        return math.exp(best) * self.cost.t(1) > self.cost.draft_ms

    def _frontier(self, candidates: TreeBuilder, level: list[int]) -> list[int]:
        """The top_k of the newest round's candidates by cumulative score, ascending."""
        scores = torch.tensor([candidates.log_scores[c] for c in level], dtype=torch.float64)
        return sorted(level[i] for i in _top(scores, self.top_k))

    def _add_children(self, candidates: TreeBuilder, nodes: list[int],
                      logprobs: torch.Tensor) -> list[int]:
        """Add the top_k children of each node from its (V,) row of `logprobs` (len(nodes), V);
        returns the new candidates' indices."""
        added = []
        for node, row in zip(nodes, logprobs.float()):
            for token in _top(row, self.top_k):
                score = candidates.log_scores[node] + float(row[token])
                added.append(candidates.add(node, token, score))
        return added


def _top(values: torch.Tensor, k: int) -> list[int]:
    """Indices of the k largest finite entries of `values` (n,), best first, ties to the lower
    index; fewer when fewer are finite (-inf marks a token the draft cannot propose).

    topk's order among equal values is unspecified and a stable sort of a 49k vocabulary costs
    ~15 ms here (topk: 0.3 ms), so only the entries tied at the k-th value are sorted stably.
    """
    k = min(k, values.numel())
    if k == 0:
        return []
    threshold = values.topk(k).values[-1]
    above = ((values >= threshold) & (values > float("-inf"))).nonzero().flatten()
    order = values[above].sort(descending=True, stable=True).indices
    return above[order][:k].tolist()


def draft_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(n, V) draft logits -> log-probabilities of the distribution drafts come from (warped
    when sampling), -inf where a token cannot be proposed: what `expand` returns."""
    if params.greedy:
        return logits.log_softmax(-1)
    return warp(logits, params).log()
