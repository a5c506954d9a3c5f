"""Static-tree policy as steps: filling a TreeTopology level by level (`fill_steps`,
`add_children`, `propose_children`, `check_depth`), and the drivers that run any tree policy
written as steps, one sequence (`run_steps`) or a batch in lockstep (`run_lockstep`), or
translate its requests (`relay`). EAGLE-2's dynamic policy (drafters.trees.dynamic) and the
per-step cost sizing (drafters.trees.cost) are written on the same steps.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch

from verify.sampling import SamplingParams, warp
from verify.tree import TreeBuilder, TreeError, TreeTopology


def check_depth(topology: TreeTopology, max_depth: int | None, drafter: str) -> None:
    """Refuse, at construction, a tree deeper than the drafter can fill, or a dynamic tree
    from a drafter that fills static topologies only."""
    if not isinstance(topology, TreeTopology):
        raise TreeError(f"{drafter} fills static trees (conf/tree with `choices`), not "
                        f"{type(topology).__name__}: EAGLE and draft-model drafters grow "
                        "dynamic trees")
    if max_depth is not None and topology.depth > max_depth:
        raise TreeError(f"tree depth {topology.depth} exceeds what {drafter} can fill "
                        f"(at most {max_depth})")


# A tree policy written as steps: a generator that yields what it needs a draft forward for
# (a request), is sent the answer, and returns its tree. One sequence answers each request as
# it comes (`run_steps`); a batch answers every row's pending request with one forward
# (`run_lockstep`), so the same policy code drafts one row or B rows in step.
Steps = Generator[Any, Any, Any]


def fill_steps(topology: TreeTopology, root: int, root_logits: torch.Tensor, depth_limit: int,
               params: SamplingParams, generator: torch.Generator | None,
               iid: bool = False) -> Steps:
    """Steps filling a static topology level by level, for drafters that run a model per level.

    root_logits (V,): the draft's prediction after the root. Each level yields (builder,
    nodes): the tree so far and its newest level's nodes that have children in the topology;
    the answer is their draft logits (len(nodes), V). Returns the TokenTree. Levels past
    `depth_limit` are left out (a draft model near the end of its position range). `iid`:
    sampled children are drawn i.i.d. (add_children).
    """
    builder = TreeBuilder(root)
    placed = {0: 0}  # topology node -> tree node
    logits = {0: root_logits}  # tree node -> (V,) draft logits after its path
    frontier = [0]  # topology nodes whose children the next level drafts
    for depth in range(1, depth_limit + 1):
        first = len(builder)
        for node in frontier:
            add_children(builder, topology, placed, node, logits[placed[node]], params,
                         generator, iid)
        frontier = [t for t, i in placed.items() if i >= first and topology.children(t)]
        if not frontier or depth == depth_limit:
            break
        nodes = [placed[t] for t in frontier]
        logits.update(zip(nodes, (yield builder, nodes)))
    return builder.build()


def run_steps(steps: Steps, answer: Callable[[Any], Any]) -> Any:
    """Drive one sequence's steps: each request gets answer(request); returns the result."""
    try:
        request = next(steps)
        while True:
            request = steps.send(answer(request))
    except StopIteration as done:
        return done.value


def run_lockstep(steps: Mapping[int, Steps],
                 answer: Callable[[dict[int, Any]], Mapping[int, Any]]) -> dict[int, Any]:
    """Drive several rows' steps together: each round, answer({row: request}) answers every
    row still asking at once. Returns {row: result}."""
    results, pending = {}, {}
    for row, row_steps in steps.items():
        try:
            pending[row] = next(row_steps)
        except StopIteration as done:
            results[row] = done.value
    while pending:
        answers, asking = answer(pending), {}
        for row, request in pending.items():
            try:
                asking[row] = steps[row].send(answers[row])
            except StopIteration as done:
                results[row] = done.value
        pending = asking
    return results


def relay(steps: Steps, ask: Callable[[Any], Steps]) -> Steps:
    """Steps that run `steps`, turning each of its requests into the requests of ask(request)
    (itself steps, whose result answers the original): a drafter wraps a tree policy's
    "expand these nodes" into "run the draft over these inputs"."""
    try:
        request = next(steps)
        while True:
            request = steps.send((yield from ask(request)))
    except StopIteration as done:
        return done.value


def add_children(builder: TreeBuilder, topology: TreeTopology, placed: dict[int, int], node: int,
                 logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None, iid: bool = False) -> None:
    """Draft the children of topology node `node` (placed at tree node placed[node]) from (V,)
    draft logits, recording where each child lands in `placed`. `iid`: sampled children are
    one i.i.d. draw per child slot, repeats merged (the multi-draft rules read the draws)."""
    kids = topology.children(node)
    tokens, q = propose_children(logits, len(kids), params, generator, iid)
    if q is not None:  # the builder holds the children to the draw order (TokenTree's notes)
        builder.set_draft_probs(placed[node], q, draws=tokens, iid=iid)
    # Children in rank order take the proposals best first; a sampled child must be the next
    # (distinct) draw, so a gap in the ranks is closed up, never skipped.
    for kid, token in zip(kids, dict.fromkeys(tokens)):
        placed[kid] = builder.add(placed[node], token)


def propose_children(logits: torch.Tensor, count: int, params: SamplingParams,
                     generator: torch.Generator | None = None, iid: bool = False
                     ) -> tuple[list[int], torch.Tensor | None]:
    """Up to `count` distinct child tokens from (V,) draft logits, best first.

    Greedy: the top-`count` tokens by logit, and None (deterministic children). Sampling: draws
    in order without replacement from q = warp(logits) (Gumbel-top-k), and q (V,) itself.
    Tokens with q = 0 are never proposed, so fewer than `count` may come back. `iid`
    (sampling): `count` draws with replacement instead, repeats included.
    """
    count = min(count, logits.shape[-1])
    if params.greedy:
        values, tokens = logits.float().topk(count)
        return tokens[values > float("-inf")].tolist(), None
    q = warp(logits, params)
    if iid:
        return torch.multinomial(q, count, replacement=True, generator=generator).tolist(), q
    # Sorting log q + Gumbel noise is sequential sampling without replacement; log 0 = -inf
    # keeps tokens without mass out whatever the noise.
    # drawn where q is (a GPU draft's logits stay on it), by a generator on that device
    uniform = torch.rand(q.shape, generator=generator, device=q.device).clamp_min(
        torch.finfo(torch.float32).tiny)
    keys = q.log() - (-uniform.log()).log()
    values, tokens = keys.topk(count)
    return tokens[values > float("-inf")].tolist(), q
