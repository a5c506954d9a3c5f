"""Traversal Verification (Weng et al., NeurIPS 2025, arXiv 2505.12398): a sampled tree judged
from its leaves up, each node on the weight of its whole path from the root.

Token-level rules (recursive rejection sampling) walk down from the root and drop a node's
whole subtree once the node is rejected. Traversal Verification visits the tree in post-order
(the first leaf of a depth-first walk first) and keeps, for every node u, a state (w_u, P_u,
Q_u): the weight of u's path (the chance it survives), the target's distribution after u
still owed, and the draft distribution u's next child is drawn from. A child c of u with
token x enters with
    w_c = min(1, w_u P_u(x) / Q_u(x))      (the path weight of block verification)
and the deepest leaf is accepted with probability w. When a node c is rejected (deleted), its
parent u absorbs the rejection as block verification's stop rule does:
    r = max(w_u P_u - Q_u, 0),  m = sum(r),  P_u <- r / m,  w_u <- m / (m + 1 - w_u),
and Q_u loses x (sampled siblings are draws without replacement); u's next child enters with
the new state. A node whose children are all deleted is a leaf: accepted with its current w,
the bonus token drawn from its current P. The root keeps w = 1, so every step ends.

Why it is exact (induction over subtrees and over a node's remaining children): a node that
enters with state (w, P, Q) survives with probability w, and given that, the first token it
emits is distributed as P (its bonus, or the child it continues through). For its next child:
P(that child has token x and survives) = Q(x) min(1, w P(x) / Q(x)) = min(Q(x), w P(x)), and
the rest of w P, the mass r, is owed by what follows a rejection, reached with probability
1 - (w - m); the new weight m / (1 - w + m) and distribution r / m pay exactly that, whatever
x was rejected. At the root (w = 1, P the target's) this is the target's distribution. On a
chain the rule is block verification (Sun et al. 2024), and like it accepts, in expectation,
never fewer tokens than the token-level rule.

Deterministic children (a node not sampled) are one-hot proposals, as the other rules treat
them. A tree without draft probabilities is refused: no node was sampled, so there is nothing
for a sequence-level rule to gain (`sampling` is optimal for one-hot drafts).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from verify.accept import Acceptance, AcceptanceRule, RuleRefusal, _without, child_proposal
from verify.sampling import sample, warp
from verify.tree import TokenTree

# One candidate of the traversal: (node, P(accept it | reached), the bonus distribution (V,)
# if it is accepted). A rejection is what asking for the next candidate means.
Candidate = tuple[int, float, torch.Tensor]


class TraversalVerificationRule(AcceptanceRule):
    """Traversal Verification of a sampled tree (module notes). `candidates` lays out the
    rule's random walk, so `outcomes` gives its result exactly, for enumeration."""

    name = "traversal"
    exact = True
    sampling_only = True
    needs_draws = True

    def __call__(self, tree, logits, params, generator=None):
        for node, chance, bonus in self.candidates(tree, warp(logits, params)):
            uniform = torch.rand((), generator=generator, device=logits.device)
            if node == 0 or float(uniform) < chance:
                return Acceptance(_path(tree, node), sample(bonus.float(), generator))
        raise AssertionError("the root is always accepted")

    def outcomes(self, tree: TokenTree, probs: torch.Tensor
                 ) -> list[tuple[list[int], float, torch.Tensor]]:
        """Every (path, probability, bonus distribution (V,)) the rule can end with, given the
        target's (N, V) probabilities after each node; the probabilities sum to 1."""
        reached, out = 1.0, []
        for node, chance, bonus in self.candidates(tree, probs):
            chance = 1.0 if node == 0 else chance
            out.append((_path(tree, node), reached * chance, bonus))
            reached *= 1 - chance
        return out

    def candidates(self, tree: TokenTree, probs: torch.Tensor) -> Iterator[Candidate]:
        """The nodes the traversal tries, in order, each with its chance and bonus
        distribution; the state moves on (the node deleted) only when the next is asked for."""
        check_sampled_tree(tree, self.name)
        yield from self._visit(tree, probs, 0, 1.0)

    def _visit(self, tree: TokenTree, probs: torch.Tensor, node: int,
               weight: float) -> Iterator[Candidate]:
        """Post-order: every child's subtree in turn, then `node` itself as a leaf. Returns
        (the generator ends) when `node` is rejected."""
        target = probs[node]
        draft = tree.draft_probs[node].to(probs) if bool(tree.sampled[node]) else None
        for child in tree.children(node):
            token = int(tree.tokens[child])
            proposal = child_proposal(draft, child, token, target)
            entry = min(1.0, weight * float(target[token] / proposal[token]))
            yield from self._visit(tree, probs, child, entry)
            weight, target = self.absorb(weight, target, proposal)
            if draft is not None:
                draft = _without(draft, token)
        yield node, weight, target

    def absorb(self, weight: float, target: torch.Tensor, proposal: torch.Tensor
               ) -> tuple[float, torch.Tensor]:
        """A node's (weight, target) after a child proposed from `proposal` was rejected."""
        residual = (weight * target - proposal).clamp_min_(0)
        mass = float(residual.sum())
        if weight >= 1 and mass <= 1e-12:  # P = Q: that rejection had probability 0
            return weight, target
        if mass <= 0:  # w P <= Q everywhere: nothing is owed, the node cannot survive
            return 0.0, target
        return min(1.0, mass / (mass + (1 - weight))), residual.div_(mass)


def check_sampled_tree(tree: TokenTree, rule: str) -> None:
    """Refuse, naming the rule, a tree that carries no draft probabilities."""
    if tree.draft_probs is None or not bool(tree.sampled.any()):
        if len(tree) > 1:
            raise RuleRefusal(f"the {rule!r} rule verifies sampled trees, but this tree has "
                              "no draft probabilities (its children were chosen, not drawn): "
                              "use 'sampling', which is optimal for chosen drafts")


def _path(tree: TokenTree, node: int) -> list[int]:
    """Node indices from the root down to `node`."""
    return tree.ancestor_mask()[node].nonzero().flatten().tolist()
