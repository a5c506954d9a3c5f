"""Multi-draft selection among siblings drawn i.i.d. from one draft distribution.

When a node's k children are k independent draws x_1..x_k from q (with replacement;
`TokenTree.iid_draws`), which of them to accept is an optimal-transport problem between the
target's p and the k-tuple's distribution (SpecTr, Sun et al. 2023). Recursive rejection
sampling is one feasible plan; SpecTr's k-sequential selection (k-SEQ) is another, with a
higher acceptance: for a rho in [1, k],

    accept x_i (the first to pass, in draw order) with probability min(1, p(x_i) / (rho q(x_i))),
    else draw the bonus from norm(max(p - min(q, p / rho) * S, 0)),

where beta = sum_x min(q(x), p(x) / rho) and S = sum_{i < k} (1 - beta)^i. Drawn this way,
token y comes out through a draft with probability min(q(y), p(y) / rho) * S, which must not
exceed p(y): that holds when S <= rho. The smallest such rho (found by bisection) gives the
largest acceptance, 1 - (1 - beta)^k. k = 1 is speculative sampling.

The optimal plan (Hu et al. 2025, "Towards Optimal Multi-draft Speculative Decoding") accepts
with probability alpha* = min over token sets H of p(H) + 1 - q(H)^k, which `optimal_acceptance`
computes (H runs over the tokens sorted by p / q, ascending). The plan itself is a transport
LP over the V^k draft tuples, with no closed form for k > 1: at this vocabulary (49,152) it is
out of reach, so the rule here is k-SEQ and alpha* its yardstick.
"""

from __future__ import annotations

import torch

from verify.accept import Acceptance, AcceptanceRule, RuleRefusal
from verify.sampling import sample, warp
from verify.traversal import check_sampled_tree
from verify.tree import TokenTree

BISECTIONS = 40  # rho to within (k - 1) / 2^40: far below float64 noise in the acceptance


class KSequentialRule(AcceptanceRule):
    """SpecTr's k-sequential selection at every node whose children are i.i.d. draws, top
    down from the root (module notes). Trees whose branching nodes are not all i.i.d. draws
    are refused, naming the node and why."""

    name = "spectr"
    exact = True
    sampling_only = True
    needs_draws = True
    needs_iid = True

    def __call__(self, tree, logits, params, generator=None):
        probs = warp(logits, params)
        self.check(tree)
        path = [0]
        while True:
            node = path[-1]
            draws = _draws(tree, node)
            if not draws:  # a leaf, or a lone root (no draft at all): the bonus comes from p
                return Acceptance(path, sample(probs[node].float(), generator))
            q = tree.draft_probs[node].to(probs)
            rho = self.rho(probs[node], q, len(draws))
            for token in draws:
                chance = min(1.0, float(probs[node, token] / (rho * q[token])))
                if float(torch.rand((), generator=generator, device=probs.device)) < chance:
                    path.append(_child(tree, node, token))
                    break
            else:
                bonus = self.residual(probs[node], q, rho, len(draws))
                return Acceptance(path, sample(bonus.float(), generator))

    def outcomes(self, tree: TokenTree, probs: torch.Tensor
                 ) -> list[tuple[list[int], float, torch.Tensor]]:
        """Every (path, probability, bonus distribution (V,)) the rule can end with, given the
        target's (N, V) probabilities after each node, exactly."""
        self.check(tree)
        out, stack = [], [([0], 1.0)]
        while stack:
            path, reach = stack.pop()
            node = path[-1]
            draws = _draws(tree, node)
            if not draws:
                out.append((path, reach, probs[node]))
                continue
            q = tree.draft_probs[node].to(probs)
            rho = self.rho(probs[node], q, len(draws))
            missed = reach
            for token in draws:
                chance = min(1.0, float(probs[node, token] / (rho * q[token])))
                stack.append(([*path, _child(tree, node, token)], missed * chance))
                missed *= 1 - chance
            out.append((path, missed, self.residual(probs[node], q, rho, len(draws))))
        return out

    def check(self, tree: TokenTree) -> None:
        """Refuse a tree in which a node with children did not draw them i.i.d."""
        check_sampled_tree(tree, self.name)
        for node in range(len(tree)):
            if not tree.children(node) or (tree.iid_draws and tree.iid_draws[node]):
                continue
            how = ("without replacement" if bool(tree.sampled[node]) else
                   "by choice (top-k or a cut), not drawn")
            raise RuleRefusal(f"the {self.name!r} rule selects among siblings drawn i.i.d., but "
                              f"node {node}'s children were drawn {how}: draw them i.i.d. "
                              "(drafter iid_siblings=true), or use 'sampling' or 'traversal'")

    def rho(self, p: torch.Tensor, q: torch.Tensor, draws: int) -> float:
        """The smallest rho in [1, draws] with S(rho) <= rho (module notes)."""
        low, high = 1.0, float(draws)
        if _spread(p, q, low, draws) <= low:
            return low
        for _ in range(BISECTIONS):
            middle = (low + high) / 2
            low, high = (low, middle) if _spread(p, q, middle, draws) <= middle else (middle, high)
        return high

    def residual(self, p: torch.Tensor, q: torch.Tensor, rho: float, draws: int
                 ) -> torch.Tensor:
        """(V,) the bonus distribution when no draft passed."""
        through = torch.minimum(q, p / rho) * _spread(p, q, rho, draws)
        owed = (p - through).clamp_min(0)
        mass = owed.sum()
        return owed / mass if mass > 0 else p

    def acceptance(self, p: torch.Tensor, q: torch.Tensor, draws: int) -> float:
        """P(some draft accepted) at a node with target p, draft q and `draws` i.i.d. draws."""
        beta = float(torch.minimum(q, p / self.rho(p, q, draws)).sum())
        return 1 - (1 - beta) ** draws


def optimal_acceptance(p: torch.Tensor, q: torch.Tensor, draws: int) -> float:
    """Hu et al.'s optimal acceptance of `draws` i.i.d. drafts from q against target p (V,):
    min over H of p(H) + 1 - q(H)^draws, H a prefix of the tokens sorted by p / q."""
    p, q = p.double(), q.double()
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, float("inf")))
    order = ratio.argsort()
    values = p[order].cumsum(0) + 1 - q[order].cumsum(0).clamp(0, 1) ** draws
    return min(1.0, float(values.min()))


def _spread(p: torch.Tensor, q: torch.Tensor, rho: float, draws: int) -> float:
    """S = sum_{i < draws} (1 - beta)^i, beta = sum min(q, p / rho): how many times over a
    token's min(q, p / rho) the drafts deliver it."""
    miss = 1 - float(torch.minimum(q, p / rho).sum())
    return sum(miss ** i for i in range(draws))


def _draws(tree: TokenTree, node: int) -> list[int]:
    """`node`'s i.i.d. draws in draw order; none for a leaf and for a tree that drew nothing
    (a lone root carries no `iid_draws` nor draft probabilities)."""
    return list(tree.iid_draws[node] or []) if tree.iid_draws is not None else []


def _child(tree: TokenTree, node: int, token: int) -> int:
    """`node`'s child holding `token`."""
    return next(c for c in tree.children(node) if int(tree.tokens[c]) == token)
