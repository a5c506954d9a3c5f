"""Exact enumeration for tree acceptance rules: every draft tree a drafter of a given shape can
draw on a tiny vocabulary (with its probability), every outcome a rule can end with on it, and
the sequence distribution that results, to compare with the target's joint exactly.

A rule is given as `outcomes(tree, probs) -> [(path, probability, bonus distribution)]`, as
TraversalVerificationRule and KSequentialRule expose it; `recursive_rejection` is the same for
recursive rejection sampling (SpeculativeSamplingRule), written out here as the reference."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from verify.sampling import SamplingParams, warp
from verify.tree import TokenTree, TreeBuilder, TreeTopology

Table = dict[tuple[int, ...], torch.Tensor]
Outcomes = list[tuple[list[int], float, torch.Tensor]]


def tables(seed: int, vocab: int, depth: int, params: SamplingParams, close: bool
           ) -> tuple[Table, Table]:
    """The target's p and the draft's q per prefix of up to `depth` tokens, float64, both
    warped by `params` (as the loop warps the target and drafters their draft). `close`: q's
    logits are p's plus noise, a draft that often agrees; else independent."""
    generator = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            logits = 2 * torch.randn(vocab, generator=generator, dtype=torch.float64)
            noise = 2 * torch.randn(vocab, generator=generator, dtype=torch.float64)
            p[prefix] = warp(logits, params).double()
            q[prefix] = warp((logits if close else 0) + noise, params).double()
    return p, q


def draws(q: torch.Tensor, count: int, iid: bool) -> Iterator[tuple[list[int], float]]:
    """Every draw sequence of `count` children from q with its probability: i.i.d. (repeats
    kept), or without replacement (fewer when q has fewer tokens with mass)."""
    support = [x for x in range(len(q)) if q[x] > 0]
    if iid:
        for seq in itertools.product(support, repeat=count):
            yield list(seq), float(torch.prod(q[list(seq)]))
        return
    for seq in itertools.permutations(support, min(count, len(support))):
        weight, left = 1.0, 1.0
        for x in seq:
            weight *= float(q[x]) / left
            left -= float(q[x])
        yield list(seq), weight


def draft_trees(topology: TreeTopology, q: Table, iid: bool
                ) -> Iterator[tuple[TokenTree, float]]:
    """Every tree a sampling drafter fills `topology` with (drafters.trees.steps.add_children:
    distinct draws take the child slots in rank order), with its probability."""
    slots = [node for node in range(topology.size) if topology.children(node)]

    def grow(index: int, builder: TreeBuilder, placed: dict[int, int], weight: float):
        if index == len(slots):
            yield builder, weight
            return
        node = slots[index]
        if node not in placed:  # its slot was left empty by repeated draws above
            yield from grow(index + 1, builder, placed, weight)
            return
        prefix = tuple(builder.tokens[n] for n in builder.path(placed[node])[1:])
        for seq, chance in draws(q[prefix], len(topology.children(node)), iid):
            grown, where = _copy(builder), dict(placed)
            grown.set_draft_probs(placed[node], q[prefix], draws=seq, iid=iid)
            for kid, token in zip(topology.children(node), dict.fromkeys(seq)):
                where[kid] = grown.add(placed[node], token)
            yield from grow(index + 1, grown, where, weight * chance)

    for builder, weight in grow(0, TreeBuilder(0), {0: 0}, 1.0):
        yield builder.build(), weight


def _copy(builder: TreeBuilder) -> TreeBuilder:
    copy = TreeBuilder(builder.tokens[0])
    for name in ("tokens", "parents", "probs", "draws", "iid_draws", "_child_count", "_depths"):
        setattr(copy, name, list(getattr(builder, name)))
    return copy


def target_rows(p: Table, tree: TokenTree) -> torch.Tensor:
    """(N, V) the target's distribution after each node's path."""
    mask = tree.ancestor_mask()
    return torch.stack([p[tuple(tree.tokens[mask[n]][1:].tolist())] for n in range(len(tree))])


def recursive_rejection(tree: TokenTree, probs: torch.Tensor) -> Outcomes:
    """SpeculativeSamplingRule's outcomes, exactly: each node's children tried in order, the
    residual norm(max(P - Q, 0)) and Q without the rejected draw after each rejection."""
    out, stack = [], [([0], 1.0)]
    while stack:
        path, reach = stack.pop()
        node = path[-1]
        target = probs[node]
        draft = tree.draft_probs[node].double() if bool(tree.sampled[node]) else None
        for child in tree.children(node):
            token = int(tree.tokens[child])
            proposal = draft if draft is not None else torch.nn.functional.one_hot(
                torch.tensor(token), len(target)).double()
            chance = min(1.0, float(target[token] / proposal[token]))
            stack.append(([*path, child], reach * chance))
            reach *= 1 - chance
            residual = (target - proposal).clamp_min(0)
            target = residual / residual.sum() if residual.sum() > 0 else target
            if draft is not None:
                draft = draft.clone()
                draft[token] = 0
                draft = draft / draft.sum() if draft.sum() > 0 else draft
        out.append((path, reach, target))
    return out


Rule = Callable[[TokenTree, torch.Tensor], Outcomes]


def emitted(rule: Rule, p: Table, q: Table, topology: TreeTopology, iid: bool) -> Counter:
    """The distribution of the first depth + 1 tokens one step emits (the target continuing
    each shorter outcome), summed over every draft tree."""
    out: Counter = Counter()
    for tree, weight in draft_trees(topology, q, iid):
        out.update(tree_emitted(rule, p, tree, topology.depth + 1, weight))
    return out


def tree_emitted(rule: Rule, p: Table, tree: TokenTree, length: int, weight: float = 1.0
                 ) -> Counter:
    """The distribution of the first `length` tokens one step emits on one given tree (the
    target continuing each shorter outcome), times `weight`."""
    out: Counter = Counter()
    for path, chance, bonus in rule(tree, target_rows(p, tree)):
        tokens = tuple(tree.tokens[path[1:]].tolist())
        for y in range(len(bonus)):
            mass = weight * chance * float(bonus[y])
            if mass > 0:
                for seq, tail in continuations(p, (*tokens, y), length):
                    out[seq] += mass * tail
    return out


def continuations(p: Table, prefix: tuple[int, ...], length: int
                  ) -> Iterator[tuple[tuple[int, ...], float]]:
    """Each sequence of `length` tokens starting with `prefix`, with the target's probability
    of the tokens after it."""
    vocab = len(p[()])
    for rest in itertools.product(range(vocab), repeat=length - len(prefix)):
        weight, seq = 1.0, tuple(prefix)
        for token in rest:
            weight *= float(p[seq][token])
            seq = (*seq, token)
        yield seq, weight


def worst_error(rule: Rule, p: Table, q: Table, topology: TreeTopology, iid: bool) -> float:
    """The largest gap between what the rule emits and the target's joint."""
    out = emitted(rule, p, q, topology, iid)
    joint = dict(continuations(p, (), topology.depth + 1))
    return max(abs(out.get(seq, 0.0) - prob) for seq, prob in set(joint.items()) | {
        (seq, joint.get(seq, 0.0)) for seq in out})


def expected_accepted(rule: Rule, tree: TokenTree, probs: torch.Tensor) -> float:
    """Expected draft tokens accepted on one tree, exactly."""
    return sum(chance * (len(path) - 1) for path, chance, _ in rule(tree, probs))
