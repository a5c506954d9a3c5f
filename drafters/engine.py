"""The draft engine: one KV cache for drafters that run a model autoregressively over a tree.

The draft model and EAGLE both keep a cache of committed entries (one per decided position)
and, while proposing, append tree levels to it: each level is a set of tree nodes fed at once,
each node attending to every committed entry and to its own fed ancestors (a tree mask, as the
verifier's). After the target has spoken, `commit` keeps the fed entries of the accepted
paths and crops the rest (the draft model: those entries are exactly what re-running the
accepted tokens would compute), or `rollback` drops the whole trees (EAGLE: the target's
real features of the accepted path replace the draft's guesses, so it re-runs them anyway).

The engine holds B sequences (rows) that draft together, one forward per tree level for all
of them, with the verifier's layout (verify/verifier.py): row b's committed entries sit at
slots 0 .. lengths[b] - 1; slots past them are stale or hold the row's fed nodes, and every
mask hides the stale ones. One sequence is the batch of one.

Geometry: a tree's root is its row's last committed entry, at position lengths[b] - 1; a node
at depth d sits at position lengths[b] - 1 + d.

`EngineDrafter` is what such a drafter shares: the protocol's batch lifecycle around the engine
and the tree policies driven for every row at once; a subclass gives its catch-up and its
per-level forward.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
from transformers import DynamicCache, PretrainedConfig

from drafters.trees.dynamic import DynamicTree, draft_log_probs
from drafters.trees.steps import Steps, check_depth, fill_steps, relay, run_lockstep
from drafters.vocab import target_ids, to_target_vocab
from verify.accept import Acceptance
from verify.protocol import DraftContext, DraftStats
from verify.runtime.cache import (
    allocated_bytes,
    cache_rows_alone,
    check_full_attention,
    move_entries,
    new_cache,
    trim,
)
from verify.tree import TokenTree, TreeBuilder, TreeTopology


class RowLengths:
    """What every draft engine keeps per row: `lengths[b]`, its committed entries."""

    lengths: torch.Tensor

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """Committed entries of the only row (B = 1)."""
        if self.rows != 1:
            raise ValueError(f"`length` is for one sequence; this engine has {self.rows}")
        return int(self.lengths[0])

    def _cropped(self, lengths: Sequence[int]) -> torch.Tensor:
        """`lengths` as the rows' new committed counts, refused unless each keeps a prefix."""
        lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        if len(lengths) != self.rows or bool((lengths > self.lengths).any()):
            raise ValueError(f"cannot crop {self.lengths.tolist()} committed entries to "
                             f"{lengths.tolist()}")
        return lengths


class DraftEngine(RowLengths):
    """A draft KV cache: per row, `lengths[b]` committed entries, then the fed nodes of its
    current tree (`fed[b]`: tree node -> cache slot)."""

    def __init__(self, config: PretrainedConfig):
        check_full_attention(config, "draft model")  # its cache is trimmed and moved too
        self.config = config
        self.forwards = 0  # draft forwards run (catch-ups and tree levels), for cost reports
        self.reset()

    def empty_copy(self) -> DraftEngine:
        """An engine for the same draft with a cache of its own (a forked drafter's)."""
        return DraftEngine(self.config)

    def reset(self, rows: int = 1) -> None:
        """Forget everything: `rows` new sequences start."""
        self.cache = new_cache(self.config)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.fed: list[dict[int, int]] = [{} for _ in range(rows)]
        self._block_start = 0  # where the last `chains` block begins

    @property
    def size(self) -> int:
        """Cache slots in use (committed, fed and stale)."""
        return self.cache.get_seq_length()

    def cache_bytes(self) -> int:
        """Bytes of key and value memory the draft's cache holds now (its layers' whole room)."""
        return allocated_bytes(self.cache)

    def _trim(self) -> None:
        """Drop the slots past the longest row and forget every tree."""
        longest = int(self.lengths.max()) if self.rows else 0
        if self.size > longest:
            trim(self.cache, longest)
        self.fed = [{} for _ in range(self.rows)]

    def crop_rows(self, lengths: Sequence[int]) -> None:
        """Keep row b's first lengths[b] committed entries only (drops every tree too)."""
        self.lengths = self._cropped(lengths)
        self._trim()

    def rollback(self) -> None:
        """Drop the trees' entries, keep the committed ones."""
        self._trim()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` (long indices, in the new order): finished rows leave."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        if self.size:
            self.cache.batch_select_indices(rows.to(self.cache.layers[0].keys.device))
        self.lengths = self.lengths[rows]
        self._trim()

    def start_rows(self, counts: Sequence[int],
                   run_row: Callable[[int, DynamicCache], None]) -> None:
        """Give every row of an empty engine its first counts[b] committed entries, each row
        run alone: run_row(b, cache) appends row b's entries to a one-row cache, and the caches
        are stacked. Prompts differ in length (40-770 tokens on Spec-Bench), and one padded
        forward would pay for all the padding: 1.3-1.7 s of a 16-row batch's first step here."""
        if self.size:
            raise RuntimeError("start_rows fills an empty engine: reset it first")
        self.cache = cache_rows_alone(self.config, self.rows, run_row)
        self.lengths = torch.as_tensor(list(counts), dtype=torch.long)
        self.forwards += 1

    def chains(self, counts: Sequence[int], dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inputs for appending counts[b] entries to row b's committed ones in one forward
        (a catch-up; padded to K = max(counts)): the (B, K) positions and the additive
        (B, 1, K, S + K) mask over the S cache slots and the block (None where plain causal
        attention is the same). Call `commit_chains(counts)` after the forward."""
        self.forwards += 1
        counts = torch.as_tensor(list(counts), dtype=torch.long)
        width, size = max(int(counts.max()), 1), self.size
        steps = torch.arange(width)
        positions = self.lengths[:, None] + steps
        self._block_start = size
        if bool((self.lengths == size).all()) and bool((counts == width).all()):
            return positions, None
        committed = (torch.arange(size)[None, :] < self.lengths[:, None])[:, None, :]
        causal = steps[None, :] <= steps[:, None]  # (K, K)
        real = steps[None, :] < counts[:, None]  # (B, K): padding queries see only themselves
        block = (causal & real[:, :, None]) | torch.eye(width, dtype=torch.bool)
        allowed = torch.cat([committed.expand(-1, width, -1), block], dim=-1)
        return positions, _additive(allowed, dtype)

    def commit_chains(self, counts: Sequence[int]) -> None:
        """Make the block `chains(counts)` fed committed: row b's first counts[b] entries."""
        start = self._block_start
        move_entries(self.cache, self.lengths, [range(start, start + int(k)) for k in counts])
        self.lengths = self.lengths + torch.as_tensor(list(counts), dtype=torch.long)

    def level(self, paths: Sequence[Sequence[list[int]]], dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Register, per row b, the nodes ending paths[b] (each root..node, as tree node ids) as
        its next fed level, padded to n = max count; returns their (B, n) positions and the
        additive (B, 1, n, S + n) mask over the S cache slots and the level. A node sees its
        row's committed entries, its fed ancestors and itself; a padding node only itself.
        Every ancestor below the root must have been fed by an earlier level."""
        self.forwards += 1
        width, size = max([1, *(len(p) for p in paths)]), self.size
        committed = torch.arange(size)[None, :] < self.lengths[:, None]  # (B, S)
        allowed = torch.cat([committed[:, None, :].expand(-1, width, -1),
                             torch.eye(width, dtype=torch.bool).repeat(self.rows, 1, 1)], -1)
        positions = (self.lengths - 1).clamp_min(0)[:, None].repeat(1, width)
        for row, row_paths in enumerate(paths):
            fed = self.fed[row]
            for column, path in enumerate(row_paths):
                if path[-1] in fed:
                    raise ValueError(f"node {path[-1]} was fed already")
                fed[path[-1]] = size + column
            for column, path in enumerate(row_paths):
                missing = [node for node in path[1:] if node not in fed]
                if missing:
                    raise ValueError(f"node {path[-1]}'s ancestors {missing} were never fed")
                allowed[row, column, [fed[node] for node in path[1:]]] = True
                positions[row, column] = self.lengths[row] - 1 + len(path) - 1
        return positions, _additive(allowed, dtype)

    def renumber(self, new_ids: dict[int, int], row: int = 0) -> None:
        """Rename row `row`'s fed nodes (old id -> new id), forgetting those left out: a drafter
        that fed candidates and kept some of them as the tree (EAGLE-2's rerank) commits by
        tree ids."""
        self.fed[row] = {new_ids[node]: slot for node, slot in self.fed[row].items()
                         if node in new_ids}

    def commit(self, paths: Sequence[Sequence[int]]) -> list[int]:
        """Keep, per row, the fed entries of the accepted paths[b] (root first; the root is
        committed already) and drop the rest of the trees; returns how many entries each row
        committed. A path's fed nodes are a prefix of it: a node is fed only after its parent."""
        sources = [fed_prefix(fed, path) for fed, path in zip(self.fed, paths, strict=True)]
        move_entries(self.cache, self.lengths, sources)
        self.lengths = self.lengths + torch.tensor([len(s) for s in sources], dtype=torch.long)
        self.fed = [{} for _ in range(self.rows)]
        return [len(s) for s in sources]


def fed_prefix(slots: dict[int, int], path: Sequence[int]) -> list[int]:
    """The slots of the fed nodes that begin an accepted `path` (root first, not counted):
    a node is fed only after its parent, so they end at its first unfed node."""
    prefix = []
    for node in path[1:]:
        if node not in slots:
            break
        prefix.append(slots[node])
    return prefix


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, n, S) bool -> (B, 1, n, S) additive mask: 0 where allowed, the dtype's minimum
    elsewhere (finite, so a row that sees little stays finite)."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class LevelRequest(NamedTuple):
    """One row's next tree level, as an EngineDrafter's `_forward_level` reads it.

    paths: each node's tree path (node ids, root first); tokens: each node's target token id;
    parent_states: (n, H) what each node's parent predicted, for a draft that reads it (EAGLE's
    draft feature), or None (a draft language model reads its cache and the token alone).
    """

    paths: list[list[int]]
    tokens: list[int]
    parent_states: torch.Tensor | None


# A row's answer to its LevelRequest: the (n, H) states its nodes predict (None for a draft
# that carries none) and their float CPU draft-vocabulary logits (n, V').
LevelAnswer = tuple[torch.Tensor | None, torch.Tensor]


class EngineDrafter(DraftStats, ABC):
    """A drafter that runs a model over the tree with a DraftEngine (the draft model, EAGLE).

    It drafts B sequences together (verify.protocol.BatchDrafter; one sequence is the batch of
    one): each proposal catches every row's cache up to its context, then grows every row's
    tree (a static topology filled level by level, or EAGLE-2's dynamic tree) in lockstep, one
    draft forward per tree level for all rows. A subclass gives what differs:

    - `_catch_up(ctxs)`: read what each row's cache lacks (the accepted path) into it, and
      return what the roots' children are drafted from;
    - `_forward_level(requests)`: one tree level of every asking row, in one forward;
    - `_depth_limit(ctx)`: how deep a row's tree may go (the draft's position range);
    - the attributes `vocab_ids` (V', or None: the whole vocabulary) and `target_vocab_size`;
    - `commits_accepted_path`: whether the trees' cache entries wait for `update_batch`,
      which then keeps the accepted path's (the draft model: they are what re-running the
      accepted tokens would compute), or are dropped once the trees are drafted (EAGLE: they
      were built on the draft's own features, which the next catch-up replaces with the
      target's). A subclass that commits writes `update_batch`.
    """

    feature_layers: tuple[int, ...] = ()  # target hidden states read (EAGLE's features)
    # sampled siblings of a static tree drawn i.i.d. (with replacement) rather than without:
    # what multi-draft rules (rule=spectr) select among
    iid_siblings: bool = False
    target_top_k: int = 0  # asks for none of the target's predictions
    max_depth = None  # a model can continue any path
    commits_accepted_path: bool
    vocab_ids: torch.Tensor | None
    target_vocab_size: int

    def __init__(self, config: PretrainedConfig, tree: TreeTopology | DynamicTree, name: str):
        if not isinstance(tree, DynamicTree):
            check_depth(tree, self.max_depth, name)
        self.tree, self.name = tree, name
        self.engine = DraftEngine(config)
        self.begin(torch.empty(0, dtype=torch.long))

    def begin(self, prompt: torch.Tensor) -> None:
        """A new sequence: forget the draft's cache (the prompt is read at the first
        proposal)."""
        self.begin_batch([prompt])

    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        """B new sequences, drafted together by `propose_batch`."""
        self.engine.reset(len(prompts))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` of the batch (finished ones leave)."""
        self.engine.keep_rows(rows)

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """`update_batch` for one sequence."""
        self.update_batch([tree], [acceptance])

    def update_batch(self, trees: list[TokenTree], acceptances: list[Acceptance]) -> None:
        """Nothing to keep: the next catch-up reads the accepted path."""

    @property
    def draft_forwards(self) -> int:
        """Draft forwards this drafter's engine ran (catch-ups and tree levels), a running
        count; a fork counts its own."""
        return self.engine.forwards

    def draft_cache_bytes(self) -> int:
        return self.engine.cache_bytes()

    def fork(self) -> EngineDrafter:
        """The same draft and settings (shared, not copied), its own empty cache."""
        twin = copy.copy(self)
        twin.engine = self.engine.empty_copy()
        twin.begin(torch.empty(0, dtype=torch.long))
        return twin

    def propose(self, ctx: DraftContext) -> TokenTree:
        """A tree rooted at ctx.tokens[-1]; fewer nodes where the draft distribution has too
        few tokens with mass."""
        if self.engine.rows != 1:
            raise ValueError(f"{self.name} holds a batch of {self.engine.rows} sequences: use "
                             "propose_batch, or begin() for one sequence")
        return self.propose_batch([ctx])[0]

    @torch.no_grad()
    def propose_batch(self, ctxs: list[DraftContext]) -> list[TokenTree]:
        """One tree per sequence of the batch (ctxs in `begin_batch`'s order), every tree
        level of every row through one draft forward."""
        if len(ctxs) != self.engine.rows:
            raise ValueError(f"{len(ctxs)} contexts for {self.engine.rows} sequences")
        self.engine.rollback()  # a tree never followed by update() must not linger
        root_states, root_logits = self._catch_up(ctxs)  # (B, H) or None, (B, V')
        trees, steps = {}, {}
        for row, ctx in enumerate(ctxs):
            root_state = None if root_states is None else root_states[row]
            depth = self._depth_limit(ctx)
            if depth < 1:  # the draft's positions end here: decode plainly
                trees[row] = TokenTree(ctx.tokens[-1:], torch.tensor([-1]))
            elif isinstance(self.tree, DynamicTree):
                steps[row] = self._dynamic_steps(row, ctx, root_state, root_logits[row], depth)
            else:
                steps[row] = self._static_steps(ctx, root_state, root_logits[row], depth)
        try:
            trees.update(run_lockstep(steps, self._forward_level))
        finally:
            if not self.commits_accepted_path:
                self.engine.rollback()
        return [trees[row] for row in range(len(ctxs))]

    @abstractmethod
    def _catch_up(self, ctxs: list[DraftContext]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Bring every row's committed cache entries up to its context, all rows in one forward
        (or each row alone when the engine is empty: DraftEngine.start_rows). Returns the
        roots' predicted states (B, H), or None for a draft that carries none, and the float
        CPU draft-vocabulary logits (B, V') of the roots' children."""

    @abstractmethod
    def _forward_level(self, requests: dict[int, LevelRequest]) -> dict[int, LevelAnswer]:
        """One tree level of every asking row through the cache (DraftEngine.level), in one
        forward; rows not asking feed a padding node. Returns each asking row's answer."""

    @abstractmethod
    def _depth_limit(self, ctx: DraftContext) -> int:
        """The deepest level a tree below ctx.tokens[-1] may reach: the tree's depth, less
        near the end of the draft's position range (0: no tree at all)."""

    def _static_steps(self, ctx: DraftContext, root_state: torch.Tensor | None,
                      root_logits: torch.Tensor, depth: int) -> Steps:
        """Steps (drafters.trees.steps) filling the static topology below the root, `depth` levels
        at most."""
        states = {0: root_state}  # tree node -> the state its children are drafted from

        def ask(request: tuple[TreeBuilder, list[int]]) -> Steps:
            builder, nodes = request
            logits = yield from self._level(
                states, nodes, [builder.path(n) for n in nodes],
                [builder.tokens[n] for n in nodes], [builder.parents[n] for n in nodes])
            return self._full_logits(logits)

        fill = fill_steps(self.tree, int(ctx.tokens[-1]), self._full_logits(root_logits), depth,
                          ctx.params, ctx.generator, self.iid_siblings)
        return (yield from relay(fill, ask))

    def _dynamic_steps(self, row: int, ctx: DraftContext, root_state: torch.Tensor | None,
                       root_logits: torch.Tensor, depth: int) -> Steps:
        """Steps growing EAGLE-2's tree (at most `depth` deep) below the root, over
        draft-vocabulary indices (ranking 8k scores instead of 49k costs ~0.3 ms less per node
        here), mapped back to target ids at the end. The fed candidates are renamed to their
        ids in the kept tree, so that committing the accepted path works as for a static
        tree."""
        states = {0: root_state}
        to_target = target_ids(self.vocab_ids, self.target_vocab_size)

        def ask(request: tuple[TreeBuilder, list[int]]) -> Steps:
            candidates, nodes = request
            logits = yield from self._level(
                states, nodes, [candidates.path(n) for n in nodes],
                [int(to_target[candidates.tokens[n]]) for n in nodes],
                [candidates.parents[n] for n in nodes])
            return draft_log_probs(logits, ctx.params)

        policy = self.tree if depth >= self.tree.depth else replace(self.tree, depth=depth)
        search = policy.search_steps(int(ctx.tokens[-1]),
                                     draft_log_probs(root_logits[None], ctx.params)[0])
        candidates = yield from relay(search, ask)
        kept = policy.rerank(candidates)
        self.engine.renumber({candidate: node for node, candidate in enumerate(kept)}, row)
        tree = candidates.build(kept)
        tree.tokens[1:] = to_target[tree.tokens[1:]]
        return tree

    def _level(self, states: dict[int, torch.Tensor | None], nodes: list[int],
               paths: list[list[int]], tokens: list[int], parents: list[int]) -> Steps:
        """Steps drafting one level: ask for the forward of `nodes` (their paths, tokens and
        parents), record the states they predict in `states`, and return their (n, V')
        draft-vocabulary logits."""
        parent_states = None if states[0] is None else torch.stack([states[p] for p in parents])
        node_states, logits = yield LevelRequest(paths, tokens, parent_states)
        if node_states is not None:
            states.update(zip(nodes, node_states))
        return logits

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V') draft-vocabulary logits -> (..., V) over the target's, -inf outside."""
        return to_target_vocab(logits, self.vocab_ids, self.target_vocab_size)
