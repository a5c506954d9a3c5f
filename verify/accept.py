"""Acceptance rules: given the target's logits at every tree node, which path is accepted.

Every rule returns the accepted root-to-node path and one bonus token drawn from the target
after the path's last node, so each target forward yields at least one token.

- greedy: the longest path whose tokens equal the target's argmax; exact for greedy decoding.
- sampling: recursive rejection sampling over siblings (SpecInfer / EAGLE style), drafts drawn
  without replacement; a chain is Leviathan / Chen speculative sampling. Exact in distribution.
- typical: Medusa's typical acceptance (settings epsilon, alpha: `make_rule`). Faster, lossy
  by design: never reported as exact.
- block: block verification (Sun et al. 2024) for chains: the whole chain judged jointly,
  exact in distribution and never fewer tokens accepted in expectation than `sampling`.

Sequence-level rules for trees live beside it (verify.traversal, verify.multidraft), and the
registry of rules by name in verify.rules. A rule that does not apply to a tree raises
RuleRefusal, naming itself and the reason.

Which proposals are draws from q and which are one-hot is each node's `TokenTree.sampled` flag:
the rules read it, never the draft rows themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from verify.predictions import TargetPredictions
from verify.sampling import SamplingParams, sample, warp
from verify.tree import TokenTree, TreeBatch


@dataclass
class Acceptance:
    """path: node indices from the root (path[0] == 0); bonus: the target's next token;
    predictions: the target's top-k after every node of the tree, for a drafter that declares
    `target_top_k > 0` (the loop adds them after the rule has accepted; None otherwise)."""

    path: list[int]
    bonus: int
    predictions: TargetPredictions | None = field(default=None, compare=False)

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (the bonus token not counted)."""
        return len(self.path) - 1


class RuleRefusal(ValueError):
    """A rule asked to verify a tree it does not apply to; the message names the rule and why
    (a tree that branches for a chain rule, one without draft probabilities for a rule of
    sampled trees, siblings that are not the draws a rule needs)."""


class AcceptanceRule:
    """Base class. `logits` is (N, V): row i is the target's prediction after tree node i."""

    name = "base"
    exact = False
    # What the rule needs of the trees it verifies, declared so that a drafter whose trees
    # never have it is refused before anything loads (drafters.rule_refusal), not mid-run:
    chains_only = False  # True: the rule verifies chains (every node <= 1 child) only
    sampling_only = False  # True: refused for greedy decoding (its gain needs sampled drafts)
    needs_draws = False  # True: children drawn from a recorded draft distribution (draft_probs)
    needs_iid = False  # True: a node's sampled siblings drawn i.i.d. (TokenTree.iid_draws)

    def __call__(self, tree: TokenTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Acceptance:
        raise NotImplementedError

    def accept_batch(self, trees: Sequence[TokenTree], batch: TreeBatch, logits: torch.Tensor,
                     params: SamplingParams, generator: torch.Generator | None = None
                     ) -> list[Acceptance]:
        """One acceptance per row of a batch; `batch` pads `trees`, `logits` is (B, N, V).
        By default the rule runs row by row, in order (the generator's draws too)."""
        return [self(tree, logits[row, :len(tree)], params, generator)
                for row, tree in enumerate(trees)]


class GreedyRule(AcceptanceRule):
    name = "greedy"
    exact = True

    def __call__(self, tree, logits, params, generator=None):
        best = logits.argmax(-1).tolist()  # (N,)
        path = [0]
        while True:
            match = [c for c in tree.children(path[-1]) if int(tree.tokens[c]) == best[path[-1]]]
            if not match:
                return Acceptance(path, best[path[-1]])
            path.append(match[0])

    def accept_batch(self, trees, batch, logits, params, generator=None):
        """Vectorized over the batch: only the (B, N) argmax leaves the logits' device. A node
        is accepted when it and each of its ancestors below the root drafted its parent's
        argmax; siblings hold distinct tokens, so the accepted nodes form one path."""
        best = logits.argmax(-1).cpu()  # (B, N)
        drafted_best = batch.tokens == best.gather(1, batch.parents.clamp_min(0))
        drafted_best &= batch.parents >= 0  # padding nodes never match
        drafted_best[:, 0] = True  # the root is decided already
        accepted = ~((~drafted_best)[:, None, :] & batch.ancestors).any(-1)  # (B, N)
        deepest = torch.where(accepted, batch.depths, -1).argmax(1)  # (B,)
        return [Acceptance(batch.ancestors[row, node].nonzero().flatten().tolist(),
                           int(best[row, node]))
                for row, node in enumerate(deepest.tolist())]


class SpeculativeSamplingRule(AcceptanceRule):
    """Recursive rejection sampling. At a node with target distribution p and children
    c1, c2, ... drawn in order without replacement from q: accept c_i with probability
    min(1, p(c_i) / q(c_i)); on rejection p <- norm(max(p - q, 0)) and c_i is removed from q.
    At a node that is not sampled (deterministic drafts) each child is a one-hot proposal.
    Trying c1, c2, ... in node order against q, q without c1, ... is exact only because node
    order is draw order (TokenTree's notes)."""

    name = "sampling"
    exact = True

    def __call__(self, tree, logits, params, generator=None):
        probs = warp(logits, params)  # (N, V)
        path = [0]
        while True:
            node = path[-1]
            child, residual = self._try_children(tree, node, probs[node], generator)
            if child is None:
                return Acceptance(path, sample(residual, generator))
            path.append(child)

    def _try_children(self, tree: TokenTree, node: int, p: torch.Tensor,
                      generator: torch.Generator | None) -> tuple[int | None, torch.Tensor]:
        q = _draft_row(tree, node)
        for child in tree.children(node):
            token = int(tree.tokens[child])
            q_child = child_proposal(q, child, token, p)
            ratio = p[token] / q_child[token]
            if torch.rand((), generator=generator, device=p.device) < ratio:
                return child, p
            p = self.residual(p, q_child)
            if q is not None:
                q = _without(q, token)
        return None, p

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The target's distribution given that a draft from q was rejected; p and q are
        (V,) or (B, V), one distribution per row."""
        r = (p - q).clamp_min(0)
        total = r.sum(-1, keepdim=True)
        # p <= q everywhere means p == q: rejection had probability 0, only rounding got here.
        return torch.where(total > 0, r / total.clamp_min(1e-30), p)

    def accept_batch(self, trees, batch, logits, params, generator=None):
        """Vectorized over the batch: every row walks its own tree, one sibling rank at a time
        for all rows at once, with the per-row rule's arithmetic (its random draws differ:
        one uniform per row and try, drawn together)."""
        probs = warp(logits, params)  # (B, N, V)
        drafts, has_draft = _draft_rows(trees, batch, probs)  # (B, N, V), (B, N)
        rank = _sibling_ranks(batch.parents)  # (B, N)
        rows = torch.arange(len(trees), device=probs.device)
        tokens = batch.tokens.to(probs.device)
        node = torch.zeros(len(trees), dtype=torch.long, device=probs.device)
        p, q = probs[rows, 0], drafts[rows, 0]
        paths = [[0] for _ in trees]
        walking = torch.ones(len(trees), dtype=torch.bool, device=probs.device)
        bonus = torch.zeros(len(trees), dtype=torch.long, device=probs.device)
        while bool(walking.any()):
            moved = torch.zeros_like(walking)
            for k in range(int(rank.max()) + 1):
                child = _kth_child(batch.parents, rank, node, k).to(probs.device)  # (B,), -1
                trying = walking & ~moved & (child >= 0)
                if not bool(trying.any()):
                    continue
                token = tokens[rows, child.clamp_min(0)]
                proposal = torch.where(has_draft[rows, node][:, None], q,
                                       torch.nn.functional.one_hot(token, p.shape[-1]).float())
                q_token = proposal[rows, token]
                if bool((trying & (q_token <= 0)).any()):
                    raise ValueError("a node drafts a token its recorded draft distribution "
                                     "gives probability 0: the drafter is inconsistent")
                ratio = p[rows, token] / q_token.clamp_min(1e-30)
                uniform = torch.rand(len(trees), generator=generator, device=probs.device)
                accept = trying & (uniform < ratio)
                reject = trying & ~accept
                p = torch.where(reject[:, None], self.residual(p, proposal), p)
                q = torch.where(reject[:, None], _without(q, token), q)
                for row in accept.nonzero().flatten().tolist():
                    paths[row].append(int(child[row]))
                node = torch.where(accept, child, node)
                p = torch.where(accept[:, None], probs[rows, node], p)
                q = torch.where(accept[:, None], drafts[rows, node], q)
                moved |= accept
            stopping = walking & ~moved  # every child rejected, or a leaf: the bonus is due
            if bool(stopping.any()):
                drawn = torch.multinomial(p[stopping], 1, generator=generator).flatten()
                bonus[stopping] = drawn
            walking = moved
        return [Acceptance(path, int(token)) for path, token in zip(paths, bonus.tolist())]


class BlockVerificationRule(AcceptanceRule):
    """Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative
    Decoding", their Algorithm 2) for a chain x_1..x_g: the draft is judged as a block rather
    than token by token. With p_i, q_i the target's and the draft's distributions after x_1..x_i
    (q_i one-hot at a node that is not sampled), the weights
        w_0 = 1,  w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i))
    give each prefix a residual r_i = max(w_i p_i - q_i, 0) of mass m_i, and a stop chance
        h_i = m_i / (m_i + 1 - w_i) for 0 < i < g,  h_g = w_g  (h_0 = 1).
    The chain is accepted up to the last i whose uniform falls below h_i, so
        P(accept exactly k) = h_k * prod_{j > k} (1 - h_j),
    and the bonus token comes from norm(r_k) (from p_g when all g are accepted). Token-level
    verification stops at the first rejection; block verification may still accept a longer
    prefix, and its expected accepted length is never below token-level's (the paper proves it
    optimal among exact verifications of a block). The gain needs sampled drafts: on a
    deterministic chain no exact rule keeps x_1..x_k more often than the target writes it,
    prod p(x_i), which token-level verification already does.

    `outcomes` gives these probabilities exactly, for enumeration; the rule draws from them.
    Trees that branch are refused: use 'sampling' (recursive rejection sampling) for them.
    """

    name = "block"
    exact = True
    chains_only = True

    def __call__(self, tree, logits, params, generator=None):
        accept, bonus = self.outcomes(tree, warp(logits, params))
        length = sample(accept, generator)
        return Acceptance(list(range(length + 1)), sample(bonus[length], generator))

    def outcomes(self, tree: TokenTree, probs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule's outcome given chain `tree` and the target's (N, V) probabilities after
        each node: (N,) P(exactly k draft tokens accepted) and (N, V) the bonus distribution
        given k, in float64. A chain's nodes are 0..N-1 from the root, so k accepted is the
        path [0, ..., k]."""
        _check_chain(tree, self.name)
        probs = probs.double()
        g, device = len(tree) - 1, probs.device
        tokens = tree.tokens[1:].to(device)
        proposals = _proposals(tree, probs)  # (g, V): q_{i} for x_{i+1}
        steps = torch.arange(g, device=device)
        q_drafted = proposals[steps, tokens]
        if bool((q_drafted <= 0).any()):
            raise ValueError("a node drafts a token its recorded draft distribution gives "
                             "probability 0: the drafter is inconsistent")
        ratios = probs[steps, tokens] / q_drafted  # p_{i-1}(x_i) / q_{i-1}(x_i), i = 1..g
        weights = [torch.ones((), dtype=probs.dtype, device=device)]
        for ratio in ratios:
            weights.append(torch.clamp(weights[-1] * ratio, max=1.0))
        weights = torch.stack(weights)  # (g + 1,)
        residual = self.residual(weights[:g, None], probs[:g], proposals)  # (g, V)
        mass = residual.sum(-1)
        denominator = mass + 1 - weights[:g]
        # 0 / 0 only where w_i = 1 and p_i = q_i: every later weight is then 1 as well, so the
        # chain never stops at i whatever h_i is
        stop = torch.where(denominator > 0, mass / denominator.clamp_min(1e-300),
                           torch.ones_like(mass))
        stop = torch.cat([stop, weights[g:]])
        stop[0] = 1.0
        # P(exactly k) = h_k * prod_{j > k} (1 - h_j): a reversed cumulative product
        later = torch.cat([torch.flip(torch.cumprod(torch.flip(1 - stop[1:], [0]), 0), [0]),
                           stop.new_ones(1)])
        accept = (stop * later).clamp_min(0)  # sums to 1: h_0 = 1
        # where m_k = 0 the chain never stops at k (P = 0): p_k there only keeps rows valid
        stopped = torch.where(mass[:, None] > 0, residual / mass.clamp_min(1e-300)[:, None],
                              probs[:g])
        return accept, torch.cat([stopped, probs[g:g + 1]])

    def residual(self, weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Unnormalised max(w p - q, 0): what the target still owes after a prefix accepted
        with weight w, row by row."""
        return (weight * p - q).clamp_min(0)


class TypicalRule(AcceptanceRule):
    """Medusa's typical acceptance: a draft token passes when its target probability exceeds
    min(epsilon, alpha * exp(-entropy)); the deepest passing path wins (ties: higher target
    log-probability). Lossy: the output distribution is not the target's."""

    name = "typical"
    exact = False

    def __init__(self, epsilon: float = 0.09, alpha: float | None = None):
        # a negative epsilon's square root (the default alpha) is complex: refused here, not
        # mid-run
        for key, value in (("epsilon", epsilon), ("alpha", 0 if alpha is None else alpha)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"typical acceptance: rule.{key} must be a number >= 0, "
                                 f"got {value!r}")
        self.epsilon = epsilon
        self.alpha = epsilon ** 0.5 if alpha is None else alpha

    def __call__(self, tree, logits, params, generator=None):
        probs = warp(logits, params)  # (N, V)
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)
        threshold = torch.minimum(torch.full_like(entropy, self.epsilon),
                                  self.alpha * torch.exp(-entropy))
        best, best_key = 0, (0, 0.0)
        ok, score = [True] * len(tree), [0.0] * len(tree)
        for i in range(1, len(tree)):
            parent, token = int(tree.parents[i]), int(tree.tokens[i])
            ok[i] = ok[parent] and bool(probs[parent, token] > threshold[parent])
            score[i] = score[parent] + float(probs[parent, token].clamp_min(1e-20).log())
            key = (int(tree.depths[i]), score[i])
            if ok[i] and key > best_key:
                best, best_key = i, key
        path = tree.ancestor_mask()[best].nonzero().flatten().tolist()
        return Acceptance(path, sample(probs[best], generator))


def _draft_row(tree: TokenTree, node: int) -> torch.Tensor | None:
    """q for `node`'s children if they were sampled; None: deterministic, one-hot proposals
    (whatever draft_probs holds: the flag decides)."""
    if not bool(tree.sampled[node]):
        return None
    return tree.draft_probs[node].float()


def _check_chain(tree: TokenTree, rule: str) -> None:
    """Refuse a tree in which some node has more than one child."""
    counts = torch.bincount(tree.parents[1:], minlength=len(tree))
    if bool((counts > 1).any()):
        node = int((counts > 1).nonzero()[0])
        raise RuleRefusal(f"the {rule!r} rule verifies chains only, but node {node} has "
                         f"{int(counts[node])} children: use the 'sampling' rule (recursive "
                         "rejection sampling) for trees")


def _proposals(tree: TokenTree, like: torch.Tensor) -> torch.Tensor:
    """(N - 1, V) the distribution each chain node's child was proposed from: its draft row
    where the node is sampled, one-hot at the child's token where it is not."""
    tokens = tree.tokens[1:].to(like.device)
    proposals = torch.nn.functional.one_hot(tokens, like.shape[-1]).to(like.dtype)
    sampled = tree.sampled[:-1].to(like.device)
    if bool(sampled.any()):
        drafts = tree.draft_probs[:-1].to(like.device, like.dtype)
        proposals = torch.where(sampled[:, None], drafts, proposals)
    return proposals


def child_proposal(q: torch.Tensor | None, child: int, token: int, like: torch.Tensor
                   ) -> torch.Tensor:
    """The distribution `child`'s `token` was proposed from: its parent's draft row `q`
    (None: a deterministic proposal, one-hot at the token, shaped like `like`). ValueError
    when a sampled child's token has no mass there."""
    proposal = q if q is not None else _one_hot(token, like)
    if proposal[token] <= 0:
        raise ValueError(f"node {child} drafts token {token}, which its recorded draft "
                         "distribution gives probability 0: the drafter is inconsistent")
    return proposal


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def _without(q: torch.Tensor, token: int | torch.Tensor) -> torch.Tensor:
    """The draft distribution (V,) or (B, V) with `token` (one per row) drawn already."""
    q = q.clone()
    if isinstance(token, int):
        q[token] = 0.0
    else:
        q[torch.arange(len(q), device=q.device), token] = 0.0
    total = q.sum(-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp_min(1e-30), q)


def _draft_rows(trees: Sequence[TokenTree], batch: TreeBatch, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's draft distribution (B, N, V), zero where the node is not sampled (and for
    padding), and (B, N) the sampled flags (False: one-hot proposals)."""
    drafts = torch.zeros_like(like)
    sampled = batch.sampled.to(like.device)
    for row, tree in enumerate(trees):
        if bool(tree.sampled.any()):
            rows = tree.draft_probs.to(like.device, torch.float32)
            drafts[row, :len(tree)] = torch.where(sampled[row, :len(tree), None], rows, 0.0)
    return drafts, sampled


def _sibling_ranks(parents: torch.Tensor) -> torch.Tensor:
    """(B, N) each node's rank among its siblings in proposal order (node order)."""
    same_parent = parents[:, :, None] == parents[:, None, :]  # (B, N, N)
    earlier = torch.ones_like(same_parent[0]).tril(-1)  # [i, j]: j < i
    return (same_parent & earlier).sum(-1)


def _kth_child(parents: torch.Tensor, rank: torch.Tensor, node: torch.Tensor, k: int
               ) -> torch.Tensor:
    """(B,) the k-th child of each row's `node`, or -1 where it has fewer children."""
    hit = (parents == node.cpu()[:, None]) & (rank == k)  # (B, N); roots' parent -1 never hits
    return torch.where(hit.any(1), hit.long().argmax(1), torch.full_like(node.cpu(), -1))
