"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure"): drafts from the target's
own earlier predictions.

Every verification forward computes the target's next-token distribution after every node of
the tree, accepted or not; plain speculative decoding throws the rejected ones away. Token
Recycling keeps, for every token, the target's top-K next tokens (and their log-probabilities)
the last time that token was verified: a table of V rows that the target writes and that
describes any text, not only text that repeats. A draft starts at the root token and follows
the table: the root's recorded top-K are its children, each child's recorded top-K its
children, and so on.

Two tree policies (the drafter's `tree`):
- a static TreeTopology (the paper's 80-node template: conf/tree/recycling80.yaml), filled
  breadth first: the node of rank r under a token takes that token's recorded rank-r
  successor; a token without a record (or with fewer than r + 1 successors) drafts nothing
  below it.
- a DynamicTree (the default: conf/tree/recycling.yaml): best first by the product of the
  recorded probabilities along a path, the estimate that the whole path is accepted, at most
  `top_k` children per node, `depth` levels and `total_tokens` nodes, then cut to the nodes
  that pay for their verification when the tree has a measured `cost` (drafters.trees.cost).

The children are chosen deterministically (draft_probs None: one-hot proposals), so greedy and
sampled decoding stay exact.

Memory and fairness (the protocol the suffix drafter follows): each request writes its own
rows over the shared table, which it reads beneath them; a request's rows join the shared
table only when the next request begins, so no request drafts from another one decoding
beside it in a batch, and none from its own earlier answer. `forget()` takes the shared table
back to its warm start (a benchmark calls it before every repeat); `warm_from` (text the
target reads once) and `memory_file` (a saved table) warm it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from drafters.base import StatelessDrafter
from drafters.config import typed_config
from drafters.suffix import warm_start
from drafters.trees.cost import cut_to_cost
from drafters.trees.dynamic import DynamicTree
from verify.accept import Acceptance
from verify.predictions import TargetPredictions
from verify.protocol import DraftContext, Resettable
from verify.runtime.files import read_json, write_json
from verify.runtime.model import Target
from verify.tree import TokenTree, TreeError, TreeTopology

# token -> (its K recorded successors, most likely first; their log-probabilities)
Row = tuple[tuple[int, ...], tuple[float, ...]]


@dataclass
class RecyclingConfig:
    """conf/drafter/recycling.yaml, typed: the only defaults of these keys."""

    name: str = "recycling"
    top_k: int = 8  # K: the target's successors recorded per token (the paper's 8)
    memory_file: str | None = None  # a saved table (RecyclingDrafter.save_memory) to start from
    warm_from: str | None = None  # JSONL of text the target reads once to fill the table
    warm_max_tokens: int = 1024  # each warm text is cut to this many tokens


class RecyclingTable:
    """The shared table: token -> the target's latest recorded successors. What it holds at
    `mark_warm` is its warm start, which `forget` goes back to."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.rows: dict[int, Row] = {}
        self._warm: dict[int, Row] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def mark_warm(self) -> None:
        self._warm = dict(self.rows)

    def forget(self) -> None:
        self.rows = dict(self._warm)

    def save(self, path: str | Path, vocab_size: int) -> None:
        """Write the rows as JSON (atomically), naming the vocabulary they index."""
        tokens = sorted(self.rows)
        write_json(Path(path), {"vocab_size": vocab_size, "top_k": self.top_k,
                                "tokens": tokens,
                                "ids": [list(self.rows[t][0]) for t in tokens],
                                "logprobs": [list(self.rows[t][1]) for t in tokens]})

    def load(self, path: str | Path, vocab_size: int) -> None:
        """Add the rows of a `save`d file; refuse one made for another vocabulary or holding a
        row that is not one (_checked_row: ids outside this vocabulary would be drafted and
        crash the target's embedding), naming the file."""
        data = read_json(path, "recycling table")
        if data.get("vocab_size") != vocab_size:
            raise ValueError(f"{path} indexes a vocabulary of {data.get('vocab_size')} tokens, "
                             f"this target has {vocab_size}: it was saved for another tokenizer")
        tokens, ids, logprobs = (data.get(key) for key in ("tokens", "ids", "logprobs"))
        if not (isinstance(tokens, list) and isinstance(ids, list)
                and isinstance(logprobs, list) and len(tokens) == len(ids) == len(logprobs)):
            raise ValueError(f'{path}: "tokens", "ids" and "logprobs" must be lists of one '
                             "length")
        for token, successors, values in zip(tokens, ids, logprobs):
            self.rows[token] = _checked_row(path, token, successors, values, vocab_size,
                                            self.top_k)


def _checked_row(path: str | Path, token, successors, values, vocab_size: int,
                 top_k: int) -> Row:
    """A saved table's row of `token`, its first `top_k` entries, refused (naming the file and
    the token) unless the successors are distinct ids of [0, vocab_size) with one
    log-probability each, every one a number <= 0: a repeated id drafts a tree with twin
    siblings, a log-probability above 0 or NaN ranks the tree's nodes wrongly."""
    where = f"{path}: the row of {token!r}"
    if not (isinstance(successors, list) and isinstance(values, list)):
        raise ValueError(f"{where} is not a list of successor ids with a list of "
                         "log-probabilities")
    bad = [t for t in [token, *successors] if type(t) is not int or not 0 <= t < vocab_size]
    if bad or len(successors) != len(values):
        raise ValueError(f"{where} holds {bad[:1] or values!r:.40}, not token ids of "
                         f"[0, {vocab_size}) with one log-probability each")
    if len(set(successors)) != len(successors):
        raise ValueError(f"{where} repeats a successor id: {successors!r:.60}")
    if not all(type(v) in (int, float) and v <= 0 for v in values):  # NaN <= 0 is False
        raise ValueError(f"{where} holds log-probabilities {values!r:.60}: each must be a "
                         "number <= 0")
    return tuple(successors[:top_k]), tuple(float(v) for v in values[:top_k])


class _Request:
    """One request's own rows, written over the shared table until the next request begins."""

    def __init__(self):
        self.rows: dict[int, Row] = {}


class RecyclingDrafter(StatelessDrafter, Resettable):
    """Drafts from the table of the target's recorded successors (see the module docstring).
    Its state is the open requests and the shared table (`begin`, `fork`)."""

    def __init__(self, tree: TreeTopology | DynamicTree,
                 config: RecyclingConfig = RecyclingConfig(),
                 table: RecyclingTable | None = None):
        if config.top_k < 1:
            raise ValueError(f"{config.name}: top_k must be >= 1, got {config.top_k}")
        _check_tree(tree, config)
        self.tree, self.config, self.name = tree, config, config.name
        self.target_top_k = config.top_k
        self.table = table if table is not None else RecyclingTable(config.top_k)
        self._open: list[_Request] = []  # this drafter's and its forks' requests, shared
        self.request: _Request | None = None

    def begin(self, prompt: torch.Tensor) -> None:
        """A new request: finished requests' rows join the shared table first."""
        self._close_finished()
        self.request = _Request()
        self._open.append(self.request)

    def propose(self, ctx: DraftContext) -> TokenTree:
        if self.request is None:
            raise ValueError(f"{self.name}: call begin() before propose()")
        root = int(ctx.tokens[-1])
        if isinstance(self.tree, TreeTopology):
            return self._fill_template(root)
        tree = self._grow(root)
        if self.tree.cost is not None and len(tree) > 1:
            tree = cut_to_cost(tree, self.tree.cost)
        return tree

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Record the target's successors after every verified node, the accepted path's
        last, so that where a token occurs at several nodes the text decoded wins."""
        if self.request is None or acceptance.predictions is None:
            return
        predictions: TargetPredictions = acceptance.predictions
        verified = predictions.verified.tolist()
        accepted = set(acceptance.path)
        order = [n for n in range(len(tree)) if n not in accepted] + list(acceptance.path)
        ids, logprobs = predictions.ids.tolist(), predictions.logprobs.tolist()
        tokens = tree.tokens.tolist()
        for node in order:
            if verified[node]:
                self.request.rows[tokens[node]] = (tuple(ids[node]), tuple(logprobs[node]))

    def fork(self) -> RecyclingDrafter:
        """Another sequence's drafter: its own request, the same shared table."""
        twin = RecyclingDrafter(self.tree, self.config, self.table)
        twin._open = self._open
        return twin

    def forget(self) -> None:
        """Take the shared table back to its warm start and drop every open request."""
        self.table.forget()
        self._open.clear()
        self.request = None

    def save_memory(self, path: str | Path, vocab_size: int) -> None:
        """Write the shared table with the open requests' rows over it to `path` (reload
        with memory_file=); the drafter's state is left as it was."""
        snapshot = RecyclingTable(self.table.top_k)
        snapshot.rows = dict(self.table.rows)
        for request in self._open:
            snapshot.rows.update(request.rows)
        snapshot.save(path, vocab_size)

    def successors(self, token: int) -> Row | None:
        """The recorded successors of `token`: this request's, else the shared table's."""
        row = self.request.rows.get(token)
        return row if row is not None else self.table.rows.get(token)

    def _fill_template(self, root: int) -> TokenTree:
        """The static template, breadth first; nodes below a token without a record (or
        without the rank asked) are left out."""
        topology = self.tree
        tokens, parents, scores = [root], [-1], [1.0]
        placed = {0: 0}  # template node -> tree node
        for node in range(1, topology.size):
            parent = placed.get(topology.parents[node])
            if parent is None:
                continue
            row = self.successors(tokens[parent])
            rank = topology.ranks[node]
            if row is None or rank >= len(row[0]):
                continue
            placed[node] = len(tokens)
            tokens.append(row[0][rank])
            parents.append(parent)
            scores.append(scores[parent] * math.exp(row[1][rank]))
        return TokenTree(tokens, parents, scores=torch.tensor(scores, dtype=torch.float64))

    def _grow(self, root: int) -> TokenTree:
        """Best first by the product of recorded probabilities: at most total_tokens nodes,
        top_k children per node, depth levels."""
        tree: DynamicTree = self.tree
        tokens, parents, scores, depths = [root], [-1], [1.0], [0]
        heap: list[tuple[float, int, int, int]] = []  # (-score, order, parent node, token)
        order = itertools.count()  # ties: the earlier pushed (shallower, higher ranked) first
        self._push_children(heap, order, 0, root, 1.0)
        while heap and len(tokens) <= tree.total_tokens:
            negative, _, parent, token = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            scores.append(-negative)
            depths.append(depths[parent] + 1)
            if depths[-1] < tree.depth:
                self._push_children(heap, order, len(tokens) - 1, token, -negative)
        return TokenTree(tokens, parents, scores=torch.tensor(scores, dtype=torch.float64))

    def _push_children(self, heap: list, order, node: int, token: int, score: float) -> None:
        row = self.successors(token)
        if row is None:
            return
        for successor, logprob in list(zip(*row))[: self.tree.top_k]:
            heapq.heappush(heap, (-score * math.exp(logprob), next(order), node, successor))

    def _close_finished(self) -> None:
        """Move the rows of requests that decoded something into the shared table (in the
        order they began); a request is finished once any request of its family begins."""
        still_open = []
        for request in self._open:
            if request.rows:
                self.table.rows.update(request.rows)
            else:  # a fork's request begun in the same batch: not decoded yet
                still_open.append(request)
        self._open[:] = still_open


def _check_tree(tree: TreeTopology | DynamicTree, config: RecyclingConfig) -> None:
    """A template whose ranks the table holds, or a dynamic tree within top_k."""
    if isinstance(tree, TreeTopology):
        deepest_rank = max(tree.ranks[1:], default=0)
        if deepest_rank >= config.top_k:
            raise TreeError(f"{config.name}: the tree asks for rank {deepest_rank} successors "
                            f"but the table keeps top_k={config.top_k}: raise "
                            f"drafter.top_k to {deepest_rank + 1} or give a narrower tree")
    elif isinstance(tree, DynamicTree):
        if tree.top_k > config.top_k:
            raise TreeError(f"{config.name}: tree.top_k={tree.top_k} children per node, but "
                            f"the table keeps drafter.top_k={config.top_k} successors per token")
    else:
        raise TreeError(f"{config.name}: give a static tree (choices) or a dynamic one "
                        f"(depth, top_k, total_tokens), got {type(tree).__name__}")


@torch.no_grad()
def warm_table(table: RecyclingTable, target: Target, texts: Sequence[Sequence[int]],
               max_tokens: int) -> None:
    """Fill the table from the target reading `texts` (token ids) once each (at most
    `max_tokens` tokens, the context window's worth at most): every position's top-K
    successors."""
    window = target.max_context or max_tokens
    model = target.model
    for ids in tqdm(texts, desc="warming the recycling table", unit="text"):
        ids = list(ids)[: min(max_tokens, window)]
        if len(ids) < 2:
            continue
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
        logprobs, successors = torch.log_softmax(logits, -1).topk(table.top_k, dim=-1)
        for token, row_ids, row_logprobs in zip(ids, successors.tolist(), logprobs.tolist()):
            table.rows[token] = (tuple(row_ids), tuple(row_logprobs))


def from_config(cfg: Mapping, tree: TreeTopology | DynamicTree, target: Target
                ) -> RecyclingDrafter:
    """conf/drafter/recycling.yaml; a warm start read by the target from text, or loaded."""
    config: RecyclingConfig = typed_config(RecyclingConfig, cfg, "recycling")
    drafter = RecyclingDrafter(tree, config)
    warm_start(drafter.table, target, config.memory_file, config.warm_from,
               lambda texts: warm_table(drafter.table, target, texts, config.warm_max_tokens))
    return drafter
