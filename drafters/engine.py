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
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PretrainedConfig

from verify.cache import allocated_bytes, cache_rows_alone, move_entries, new_cache, trim


class DraftEngine:
    """A draft KV cache: per row, `lengths[b]` committed entries, then the fed nodes of its
    current tree (`fed[b]`: tree node -> cache slot)."""

    def __init__(self, config: PretrainedConfig):
        self.config = config
        self.forwards = 0  # draft forwards run (catch-ups and tree levels), for cost reports
        self.reset()

    def reset(self, rows: int = 1) -> None:
        """Forget everything: `rows` new sequences start."""
        self.cache = new_cache(self.config)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.fed: list[dict[int, int]] = [{} for _ in range(rows)]
        self._block_start = 0  # where the last `chains` block begins

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """Committed entries of the only row (B = 1)."""
        if self.rows != 1:
            raise ValueError(f"`length` is for one sequence; this engine has {self.rows}")
        return int(self.lengths[0])

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
        lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        if len(lengths) != self.rows or bool((lengths > self.lengths).any()):
            raise ValueError(f"cannot crop {self.lengths.tolist()} committed entries to "
                             f"{lengths.tolist()}")
        self.lengths = lengths
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
        sources = []
        for fed, path in zip(self.fed, paths, strict=True):
            slots = []
            for node in path[1:]:
                if node not in fed:
                    break
                slots.append(fed[node])
            sources.append(slots)
        move_entries(self.cache, self.lengths, sources)
        self.lengths = self.lengths + torch.tensor([len(s) for s in sources], dtype=torch.long)
        self.fed = [{} for _ in range(self.rows)]
        return [len(s) for s in sources]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, n, S) bool -> (B, 1, n, S) additive mask: 0 where allowed, the dtype's minimum
    elsewhere (finite, so a row that sees little stays finite)."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def with_own_engine(drafter):
    """A shallow copy of `drafter` (the same modules and settings) with its own empty
    DraftEngine: another sequence's drafter state, sharing the weights."""
    twin = copy.copy(drafter)
    twin.engine = DraftEngine(drafter.engine.config)
    return twin
