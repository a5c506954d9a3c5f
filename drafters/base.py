"""Shared pieces of the drafters; the protocol itself lives in verify.protocol."""

from __future__ import annotations

import torch

from verify.protocol import DraftContext, Drafter
from verify.sampling import SamplingParams, warp
from verify.tree import TreeBuilder, TreeError, TreeTopology

__all__ = ["DraftContext", "Drafter", "add_children", "check_depth", "propose_children"]


def check_depth(topology: TreeTopology, max_depth: int | None, drafter: str) -> None:
    """Refuse, at construction, a tree deeper than the drafter can fill, or a dynamic tree
    from a drafter that fills static topologies only."""
    if not isinstance(topology, TreeTopology):
        raise TreeError(f"{drafter} fills static trees (conf/tree with `choices`), not "
                        f"{type(topology).__name__}: EAGLE drafters grow dynamic trees")
    if max_depth is not None and topology.depth > max_depth:
        raise TreeError(f"tree depth {topology.depth} exceeds what {drafter} can fill "
                        f"(at most {max_depth})")


def add_children(builder: TreeBuilder, topology: TreeTopology, placed: dict[int, int], node: int,
                 logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> None:
    """Draft the children of topology node `node` (placed at tree node placed[node]) from (V,)
    draft logits, recording where each child lands in `placed`."""
    kids = topology.children(node)
    tokens, q = propose_children(logits, len(kids), params, generator)
    if q is not None:
        builder.set_draft_probs(placed[node], q)
    # Children in rank order take the proposals best first; a sampled child must be the next
    # draw without replacement, so a gap in the ranks is closed up, never skipped.
    for kid, token in zip(kids, tokens):
        placed[kid] = builder.add(placed[node], token)


def propose_children(logits: torch.Tensor, count: int, params: SamplingParams,
                     generator: torch.Generator | None = None
                     ) -> tuple[list[int], torch.Tensor | None]:
    """Up to `count` distinct child tokens from (V,) draft logits, best first.

    Greedy: the top-`count` tokens by logit, and None (deterministic children). Sampling: draws
    in order without replacement from q = warp(logits) (Gumbel-top-k), and q (V,) itself.
    Tokens with q = 0 are never proposed, so fewer than `count` may come back.
    """
    count = min(count, logits.shape[-1])
    if params.greedy:
        values, tokens = logits.float().topk(count)
        return tokens[values > float("-inf")].tolist(), None
    q = warp(logits, params)
    # Sorting log q + Gumbel noise is sequential sampling without replacement; log 0 = -inf
    # keeps tokens without mass out whatever the noise.
    uniform = torch.rand(q.shape, generator=generator).clamp_min(torch.finfo(torch.float32).tiny)
    keys = q.log() - (-uniform.log()).log()
    values, tokens = keys.topk(count)
    return tokens[values > float("-inf")].tolist(), q
