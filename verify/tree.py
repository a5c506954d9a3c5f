"""Token trees: what a drafter proposes and the verifier checks in one target forward.

A tree has N nodes in topological order. Node 0 is the root: the last token already decided
(the previous step's bonus token, or the first generated token) whose key/value the target has
not computed yet. Every other node i has a parent `parents[i] < i`. A node's depth is its
distance from the root, so the target sees node i at position `cache_len + depth[i]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# How far a sampled node's draft row may sum from 1: float32 softmax and top-p renormalisation
# over a 49k vocabulary land within ~1e-6; a wrong row (scaled, unnormalised) is off by far more.
DISTRIBUTION_TOLERANCE = 1e-3


class TreeError(ValueError):
    """A malformed tree, or one a drafter cannot fill."""


@dataclass(frozen=True)
class TreeTopology:
    """A static tree shape in Medusa's "choices" format, without tokens.

    A choice is a path of ranks from the root: (0,) is the root's best child, (1, 0) the best
    child of the root's second-best child. The root itself is implicit (node 0).
    """

    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]  # (N,), -1 for the root
    ranks: tuple[int, ...]  # (N,), rank among siblings; 0 for the root

    @staticmethod
    def from_choices(choices: Sequence[Sequence[int]]) -> TreeTopology:
        paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        index = {(): 0}
        parents, ranks = [-1], [0]
        for path in paths:
            if not path or min(path) < 0:
                raise TreeError(f"choice {list(path)} must be a non-empty list of ranks >= 0")
            if path[:-1] not in index:
                raise TreeError(f"choice {list(path)} has no parent {list(path[:-1])} in the tree")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        return TreeTopology(tuple(paths), tuple(parents), tuple(ranks))

    @staticmethod
    def chain(length: int) -> TreeTopology:
        return TreeTopology.from_choices([(0,) * d for d in range(1, length + 1)])

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max((len(c) for c in self.choices), default=0)

    def children(self, node: int) -> list[int]:
        """Children of `node`, ordered by rank."""
        kids = [i for i, p in enumerate(self.parents) if p == node]
        return sorted(kids, key=lambda i: self.ranks[i])


@dataclass
class TokenTree:
    """Draft tokens arranged as a tree.

    tokens:      (N,) long, tokens[0] is the root.
    parents:     (N,) long, parents[0] == -1, parents[i] < i otherwise.
    draft_probs: optional (N, V) float; row u is the draft distribution q from which u's
                 children were drawn (in order, without replacement) where u is sampled.
    scores:      optional (N,) float, the drafter's estimate that each node's whole path is
                 accepted (root 1.0; a child never above its parent). Only tree policies read
                 them (a hybrid drafter's merge, a cost-sized cut); acceptance never does.
    sampled:     (N,) bool, what acceptance rules read: True where u's children were drawn
                 from draft_probs[u] in node order (successive draws without replacement),
                 False where they were chosen deterministically (top-k, n-gram matches, a cut
                 or merge): exact sampling then treats each as a one-hot proposal, whatever
                 draft_probs[u] holds. Not given: True exactly where draft_probs has a
                 non-zero row (the convention drafters used before the flag). A sampled node
                 needs a row that is a distribution (entries >= 0 summing to 1 within
                 DISTRIBUTION_TOLERANCE) and gives each of its children's tokens mass.
    iid_draws:   optional, per node None or the tokens drawn for its children i.i.d. (with
                 replacement) from draft_probs[u], in draw order, repeats included: its
                 children are the distinct draws in the order they first came. Only sampled
                 nodes have them; a node without them drew its children without replacement
                 (or chose them). Multi-draft rules (verify.multidraft) read the draws; the
                 others see the distinct children, which are draws without replacement.

    Sibling order is draw order. Recursive rejection sampling tries a sampled node's
    children in node order, the first against q, the next against q without the first, and so
    on: that is exact only when node order is the order the drafter drew them in. Draws
    without replacement are not exchangeable (P(a then b) = q_a q_b / (1 - q_a) differs from
    P(b then a)), so children sorted or shuffled after drawing bias the output, silently. A
    transform that renumbers nodes goes through `reorder` (which refuses to reorder a sampled
    node's children); one that leaves nodes out or merges trees drops the flags (`keep`).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    iid_draws: Sequence[Sequence[int] | None] | None = None
    depths: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).flatten()
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).flatten()
        self._validate()
        self.sampled = self._sampled_flags()
        self._check_iid_draws()
        depths = [0] * len(self.parents)
        for i in range(1, len(depths)):
            depths[i] = depths[int(self.parents[i])] + 1
        self.depths = torch.tensor(depths, dtype=torch.long)

    def _validate(self) -> None:
        n = len(self.tokens)
        if n == 0 or len(self.parents) != n:
            raise TreeError(f"a tree needs a root and one parent per token: {n} tokens, "
                            f"{len(self.parents)} parents")
        if int(self.parents[0]) != -1:
            raise TreeError("node 0 must be the root (parent -1)")
        for i in range(1, n):
            p = int(self.parents[i])
            if not 0 <= p < i:
                raise TreeError(f"node {i} has dangling parent {p}: parents must precede children")
        seen = set()
        for i in range(1, n):
            key = (int(self.parents[i]), int(self.tokens[i]))
            if key in seen:
                raise TreeError(f"node {i} repeats token {key[1]} among its siblings")
            seen.add(key)
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise TreeError(f"draft_probs has {self.draft_probs.shape[0]} rows for {n} nodes")
        if self.scores is not None and self.scores.shape != (n,):
            raise TreeError(f"scores has shape {tuple(self.scores.shape)} for {n} nodes")

    def _sampled_flags(self) -> torch.Tensor:
        """The (N,) sampled flags, given or derived from draft_probs, checked against it."""
        n, q = len(self.tokens), self.draft_probs
        mass = None if q is None else q.sum(-1).cpu()
        if self.sampled is None:
            if q is None:
                return torch.zeros(n, dtype=torch.bool)
            sampled = (q != 0).any(-1).cpu()
        else:
            sampled = torch.as_tensor(self.sampled, dtype=torch.bool).flatten().cpu()
        if sampled.shape != (n,):
            raise TreeError(f"sampled has shape {tuple(sampled.shape)} for {n} nodes")
        if not bool(sampled.any()):
            return sampled
        if q is None:
            raise TreeError(f"nodes {sampled.nonzero().flatten().tolist()} are marked sampled "
                            "but the tree has no draft_probs to have drawn their children from")
        _check_distributions(q, mass, sampled)
        self._check_draws(q, sampled)
        return sampled

    def _check_draws(self, q: torch.Tensor, sampled: torch.Tensor) -> None:
        """Every child of a sampled node is a draw from its q: its token must have mass there."""
        kids = (sampled[self.parents.clamp_min(0)] & (self.parents >= 0)).nonzero().flatten()
        if len(kids):
            tokens, vocab = self.tokens[kids], q.shape[-1]
            outside = tokens >= vocab
            mass = q[self.parents[kids].to(q.device),
                     tokens.clamp_max(vocab - 1).to(q.device)].cpu()
            bad = kids[outside | (mass <= 0)]
            if len(bad):
                node = int(bad[0])
                raise TreeError(f"node {node} drafts token {int(self.tokens[node])}, which its "
                                f"sampled parent {int(self.parents[node])}'s draft distribution "
                                "gives probability 0: a sampled child must be a draw from it")

    def _check_iid_draws(self) -> None:
        """Refuse i.i.d. draws on a node that is not sampled, or whose distinct draws, in the
        order they first came, are not its children in node order."""
        if self.iid_draws is None:
            return
        if len(self.iid_draws) != len(self.tokens):
            raise TreeError(f"iid_draws has {len(self.iid_draws)} entries for "
                            f"{len(self.tokens)} nodes")
        self.iid_draws = [None if d is None else [int(t) for t in d] for d in self.iid_draws]
        for node, draws in enumerate(self.iid_draws):
            if draws is None:
                continue
            if not bool(self.sampled[node]):
                raise TreeError(f"node {node} has i.i.d. draws but is not sampled")
            kids = self.tokens[self.children(node)].tolist()
            if list(dict.fromkeys(draws)) != kids:
                raise TreeError(f"node {node}'s children {kids} are not its distinct i.i.d. "
                                f"draws {draws} in the order they first came")

    # -- construction -------------------------------------------------------------------------

    @staticmethod
    def from_paths(root: int, paths: Sequence[Sequence[int]]) -> TokenTree:
        """Merge token paths (each starting below the root) into a trie; shared prefixes merge."""
        builder = TreeBuilder(root)
        for path in paths:
            node = 0
            for token in path:
                node = builder.child(node, int(token))
        return builder.build()

    @staticmethod
    def from_choices(root: int, topology: TreeTopology, tokens: Sequence[int]) -> TokenTree:
        """Fill a static topology: `tokens[i]` is the token of topology node i (i >= 1)."""
        if len(tokens) != topology.size - 1:
            raise TreeError(f"{len(tokens)} tokens for a topology of {topology.size - 1} nodes")
        return TokenTree(torch.tensor([root, *tokens]), torch.tensor(topology.parents))

    def keep(self, nodes: Sequence[int]) -> TokenTree:
        """The tree of `nodes` only: ascending ids from the root, closed under ancestors.

        The result carries no draft probabilities and no node is sampled: which nodes a cut
        keeps depends on the drawn tokens (their scores), so the kept children are no longer
        draws from q, even where all of a node's children stay. They become one-hot
        proposals, which stay exact whichever children a drafter chose (independently of the
        target's draws).
        """
        nodes = list(nodes)
        index = {node: i for i, node in enumerate(nodes)}
        if not nodes or nodes[0] != 0 or nodes != sorted(index):
            raise TreeError(f"kept nodes must be ascending from the root 0, got {nodes}")
        missing = [n for n in nodes[1:] if int(self.parents[n]) not in index]
        if missing:
            raise TreeError(f"kept nodes {missing} lack their parents")
        parents = [-1] + [index[int(self.parents[n])] for n in nodes[1:]]
        scores = None if self.scores is None else self.scores[nodes]
        return TokenTree(self.tokens[nodes], torch.tensor(parents), scores=scores)

    def reorder(self, order: Sequence[int]) -> TokenTree:
        """The same tree with its nodes renumbered: new node i is old node `order[i]` (every
        node once, the root first, parents before children). Draft rows, sampled flags, i.i.d.
        draws and scores move with their nodes. Deterministic siblings may change places; a sampled
        node's children must keep their order (draw order, see the class notes): TreeError
        otherwise."""
        order = [int(node) for node in order]
        if sorted(order) != list(range(len(self))) or order[0] != 0:
            raise TreeError(f"a reorder lists every node of {len(self)} once, the root first; "
                            f"got {order}")
        check_draw_order(self, order)
        index = {node: i for i, node in enumerate(order)}
        parents = [-1] + [index[int(self.parents[node])] for node in order[1:]]
        pick = torch.tensor(order)
        return TokenTree(self.tokens[pick], torch.tensor(parents),
                         None if self.draft_probs is None else self.draft_probs[pick.to(
                             self.draft_probs.device)],
                         None if self.scores is None else self.scores[pick],
                         self.sampled[pick],
                         None if self.iid_draws is None else [self.iid_draws[n] for n in order])

    # -- derived views --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def children(self, node: int) -> list[int]:
        """Children of `node` in the order they were proposed."""
        return (self.parents == node).nonzero().flatten().tolist()

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: mask[i, j] is True when j is i or an ancestor of i."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[int(self.parents[i])]
        return mask

    def position_ids(self, offset: int) -> torch.Tensor:
        """(N,) long: the position each node takes in the sequence after `offset` cached tokens."""
        return self.depths + offset

    def leaf_paths(self) -> list[list[int]]:
        """Root-to-leaf node index paths, one per leaf, in node order of the leaves."""
        has_child = torch.zeros(len(self), dtype=torch.bool)
        has_child[self.parents[1:]] = True
        mask = self.ancestor_mask()
        return [mask[leaf].nonzero().flatten().tolist() for leaf in range(len(self))
                if not has_child[leaf]]


def _check_distributions(q: torch.Tensor, mass: torch.Tensor, sampled: torch.Tensor) -> None:
    """Refuse a sampled node whose draft row (q (N, V), its row sums `mass` (N,)) is not a
    distribution: exact sampling divides by q, so a row scaled up or holding negative entries
    biases the output without any error (a x10 row made a token the target gives 10% win 91%)."""
    nodes = sampled.nonzero().flatten()
    negative = nodes[(q[nodes.to(q.device)].amin(-1) < 0).cpu()]
    if len(negative):
        raise TreeError(f"node {int(negative[0])} is sampled but its draft_probs row has "
                        "negative entries: a sampled node's q must be a distribution")
    empty = nodes[mass[nodes] <= 0]
    if len(empty):
        raise TreeError(f"nodes {empty.tolist()} are marked sampled but their draft_probs rows "
                        "are all zero")
    off = nodes[~((mass[nodes] - 1).abs() <= DISTRIBUTION_TOLERANCE)]  # NaN is off too
    if len(off):
        node = int(off[0])
        raise TreeError(f"node {node} is sampled but its draft_probs row sums to "
                        f"{float(mass[node]):.6g}: a sampled node's q must be a distribution "
                        f"(entries >= 0 summing to 1 within {DISTRIBUTION_TOLERANCE})")


def check_draw_order(tree: TokenTree, order: Sequence[int]) -> None:
    """Refuse a renumbering (new node i is old node `order[i]`) that puts a sampled node's
    children out of their order: node order is their draw order, the order exact sampling
    tries them in (TokenTree's notes). Deterministic siblings may move freely."""
    position = {int(node): i for i, node in enumerate(order)}
    for node in tree.sampled.nonzero().flatten().tolist():
        placed = [position[kid] for kid in tree.children(node) if kid in position]
        if placed != sorted(placed):
            raise TreeError(f"node {node}'s children were sampled in the order "
                            f"{tree.children(node)}: renumbered they would be tried in another "
                            "order, which biases exact sampling; keep sampled siblings in "
                            "draw order (or drop the flags, as TokenTree.keep does)")


class TreeBuilder:
    """A tree grown node by node: tries (TokenTree.from_paths), filled topologies
    (drafters.trees.steps.fill_steps), and every candidate of a dynamic tree
    (drafters.trees.dynamic).

    Node 0 is the root; node i > 0 has `parents[i] < i`, so nodes are numbered in the order
    they were added and a parent always precedes its children.
    tokens, parents: lists of length C (nodes, root included).
    log_scores: with `scored=True`, per node the drafter's log-estimate that the node's whole
    path is accepted (a cumulative draft log-probability; the root's is 0), given to every
    `add`; None for a builder without scores. A built tree carries exp(log_scores) as its
    TokenTree.scores.
    """

    def __init__(self, root: int, scored: bool = False):
        self.tokens = [int(root)]
        self.parents = [-1]
        self.log_scores: list[float] | None = [0.0] if scored else None
        self.probs: list[torch.Tensor | None] = [None]
        self.draws: list[list[int] | None] = [None]  # per node: its children's draw order
        self.iid_draws: list[list[int] | None] = [None]  # per node: draws with replacement
        self._child_count = [0]
        self._depths = [0]

    def add(self, parent: int, token: int, log_score: float | None = None) -> int:
        """Append a new child of `parent` (with its cumulative `log_score` in a scored
        builder, none otherwise); returns its node index."""
        if not 0 <= parent < len(self.tokens):
            raise TreeError(f"parent {parent} does not exist (tree has {len(self.tokens)} nodes)")
        if (log_score is None) != (self.log_scores is None):
            raise TreeError("a scored builder needs a score for every node, an unscored one "
                            f"takes none (got {log_score!r})")
        draws, rank = self.draws[parent], self._child_count[parent]
        if draws is not None and (rank >= len(draws) or draws[rank] != int(token)):
            expected = f"draw {rank}, token {draws[rank]}" if rank < len(draws) else "none"
            raise TreeError(f"node {parent}'s children are sampled: its child {rank} must be "
                            f"the next draw ({expected}), got token {int(token)}; sampled "
                            "siblings stay in draw order, none skipped (TokenTree's notes)")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self._child_count[parent] += 1
        if self.log_scores is not None:
            self.log_scores.append(log_score)
        self.probs.append(None)
        self.draws.append(None)
        self.iid_draws.append(None)
        self._child_count.append(0)
        self._depths.append(self._depths[parent] + 1)
        return len(self.tokens) - 1

    def child(self, parent: int, token: int) -> int:
        """The child of `parent` holding `token`, added if missing (unscored builders)."""
        for i in range(1, len(self.tokens)):
            if self.parents[i] == parent and self.tokens[i] == token:
                return i
        return self.add(parent, token)

    def set_draft_probs(self, node: int, probs: torch.Tensor,
                        draws: Sequence[int] | None = None, iid: bool = False) -> None:
        """Record the draft distribution (V,) that `node`'s children are drawn from, which
        makes `node` sampled in the built tree. `draws`: the tokens in the order they were
        drawn (without replacement; `iid`: with replacement, repeats included), given before
        any child is added; `add` then refuses a child of `node` that is not the next
        (distinct) draw, so sibling order is draw order."""
        if not 0 <= node < len(self.tokens):
            raise TreeError(f"set_draft_probs: node {node} does not exist (tree has "
                            f"{len(self.tokens)} nodes)")
        known = next((p for p in self.probs if p is not None), None)
        size = known.shape[-1] if known is not None else probs.shape[-1]
        if probs.dim() != 1 or probs.shape[-1] != size:
            raise TreeError(f"set_draft_probs: node {node}'s row has shape {tuple(probs.shape)}; "
                            f"the tree's draft rows are ({size},), one per vocabulary entry")
        if draws is not None:
            if self._child_count[node]:
                raise TreeError(f"node {node} has children already: record its draws before "
                                "adding them")
            draws = [int(token) for token in draws]
            self.draws[node] = list(dict.fromkeys(draws))
            self.iid_draws[node] = draws if iid else None
        elif iid:
            raise TreeError("i.i.d. draws are recorded with the tokens drawn (draws=)")
        self.probs[node] = probs

    def __len__(self) -> int:
        return len(self.tokens)

    def depth(self, node: int) -> int:
        return self._depths[node]

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, both included."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def build(self, kept: Sequence[int] | None = None) -> TokenTree:
        """The TokenTree of every node, or of the `kept` nodes only: ascending indices from
        the root, closed under ancestors (so parents still come first). Draft probabilities
        come with the whole tree only (nodes with one recorded are the sampled ones): with
        siblings left out, the kept children are no longer successive draws from q
        (TokenTree.keep says why that stays exact)."""
        if kept is None:
            sampled = torch.tensor([p is not None for p in self.probs])
            draft_probs = self._draft_probs()
            iid = self.iid_draws if any(d is not None for d in self.iid_draws) else None
            return TokenTree(torch.tensor(self.tokens), torch.tensor(self.parents),
                             draft_probs, self._scores(range(len(self))),
                             sampled if draft_probs is not None else None, iid)
        # Built directly rather than through TokenTree.keep: a dynamic tree keeps a few
        # nodes of hundreds of candidates every step, and validating them all costs time.
        index = {node: i for i, node in enumerate(kept)}
        parents = [-1] + [index[self.parents[node]] for node in kept[1:]]
        return TokenTree(torch.tensor([self.tokens[n] for n in kept]), torch.tensor(parents),
                         scores=self._scores(kept))

    def _scores(self, nodes: Sequence[int]) -> torch.Tensor | None:
        """(len(nodes),) float64 exp(log_scores) of `nodes`: the draft's estimate that each
        node's whole path is accepted; None for an unscored builder."""
        if self.log_scores is None:
            return None
        return torch.tensor([self.log_scores[n] for n in nodes], dtype=torch.float64).exp()

    def _draft_probs(self) -> torch.Tensor | None:
        """(C, V) rows of the recorded draft distributions (zero where none was recorded:
        deterministic children, not sampled), or None when no node has one."""
        known = [p for p in self.probs if p is not None]
        if not known:
            return None
        draft_probs = torch.zeros(len(self.tokens), known[0].shape[-1])
        for i, p in enumerate(self.probs):
            if p is not None:
                draft_probs[i] = p
        return draft_probs


@dataclass
class TreeBatch:
    """B token trees padded to N nodes.

    tokens, depths: (B, N) long (padding nodes hold token 0 at depth 0);
    parents: (B, N) long, -1 for each root and every padding node;
    sizes: (B,) long, the real node count of each row;
    ancestors: (B, N, N) bool, ancestors[b, i, j] when j is i or an ancestor of i. A padding
    node sees only itself, so no attention row is empty (an empty row gives NaN with sdpa);
    sampled: (B, N) bool, each tree's sampled flags (TokenTree.sampled), False for padding.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    sizes: torch.Tensor
    ancestors: torch.Tensor
    sampled: torch.Tensor

    @staticmethod
    def pad(trees: Sequence[TokenTree], width: int = 1) -> TreeBatch:
        """`trees` padded to the largest one, or to `width` nodes if that is more."""
        width = max(width, *(len(tree) for tree in trees))
        tokens, parents, depths, ancestors = _padding(len(trees), width)
        sampled = torch.zeros_like(tokens, dtype=torch.bool)
        for row, tree in enumerate(trees):
            n = len(tree)
            tokens[row, :n] = tree.tokens
            parents[row, :n] = tree.parents
            depths[row, :n] = tree.depths
            ancestors[row, :n, :n] = tree.ancestor_mask()
            sampled[row, :n] = tree.sampled
        sizes = torch.tensor([len(tree) for tree in trees], dtype=torch.long)
        return TreeBatch(tokens, parents, depths, sizes, ancestors, sampled)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def widen(self, width: int) -> TreeBatch:
        """This batch with padding nodes added up to `width` nodes (itself if already as wide)."""
        if width <= self.width:
            return self
        tokens, parents, depths, ancestors = _padding(len(self.tokens), width)
        n = self.width
        tokens[:, :n], parents[:, :n], depths[:, :n] = self.tokens, self.parents, self.depths
        ancestors[:, :n, :n] = self.ancestors
        sampled = torch.zeros_like(tokens, dtype=torch.bool)
        sampled[:, :n] = self.sampled
        return TreeBatch(tokens, parents, depths, self.sizes, ancestors, sampled)


def _padding(rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """(rows, width) tokens, parents, depths and (rows, width, width) ancestors holding only
    padding nodes: token 0 at depth 0, no parent, seeing only itself."""
    tokens = torch.zeros(rows, width, dtype=torch.long)
    ancestors = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)
    return tokens, torch.full_like(tokens, -1), torch.zeros_like(tokens), ancestors
