"""The draft engine: one KV cache for drafters that run a model autoregressively over a tree.

The draft model and EAGLE both keep a cache of committed entries (one per decided position)
and, while proposing, append tree levels to it: each level is a set of tree nodes fed at once,
each node attending to every committed entry and to its own fed ancestors (a tree mask, as the
verifier's). After the target has spoken, `commit` keeps the fed entries of the accepted path
and crops the rest (the draft model: those entries are exactly what re-running the accepted
tokens would compute), or `rollback` drops the whole tree (EAGLE: the target's real features
of the accepted path replace the draft's guesses, so it re-runs them anyway).

Geometry: the tree's root is the last committed entry, at position `length - 1`; a node at
depth d sits at position length - 1 + d.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, PretrainedConfig

from verify.verifier import keep_entries


class DraftEngine:
    """A draft KV cache: `length` committed entries, then the fed nodes of the current tree."""

    def __init__(self, config: PretrainedConfig):
        self.config = config
        self.forwards = 0  # draft forwards run (catch-ups and tree levels), for cost reports
        self.reset()

    def reset(self) -> None:
        """Forget everything: a new sequence starts."""
        self.cache = DynamicCache(config=self.config)
        self.length = 0
        self.fed: dict[int, int] = {}  # tree node -> its entry's offset after the committed ones

    def cache_bytes(self) -> int:
        """Bytes the draft's keys and values take now (committed and fed entries)."""
        return sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))

    def crop(self, length: int) -> None:
        """Keep the first `length` committed entries only (drops any tree too)."""
        if length > self.length:
            raise ValueError(f"cannot crop {self.length} committed entries to {length}")
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # DynamicLayer.crop takes the number of entries to remove
        self.length, self.fed = length, {}

    def rollback(self) -> None:
        """Drop the tree's entries, keep the committed ones."""
        self.crop(self.length)

    def extend(self, count: int) -> None:
        """Mark `count` entries just appended by a causal forward as committed."""
        if self.fed:
            raise RuntimeError("committed entries cannot follow a tree: rollback or commit first")
        self.length += count
        self.forwards += 1

    def level(self, paths: list[list[int]], dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Register the nodes ending `paths` (each root..node, as tree node ids) as the next
        fed level; returns their positions (n,) and additive mask (1, 1, n, cached + n), where
        cached counts committed and earlier fed entries. Every ancestor below the root must
        have been fed by an earlier level."""
        self.forwards += 1
        for path in paths:
            if path[-1] in self.fed:
                raise ValueError(f"node {path[-1]} was fed already")
            self.fed[path[-1]] = len(self.fed)
        width = self.length + len(self.fed)
        allowed = torch.zeros(len(paths), width, dtype=torch.bool)
        allowed[:, :self.length] = True
        for row, path in enumerate(paths):
            missing = [node for node in path[1:] if node not in self.fed]
            if missing:
                raise ValueError(f"node {path[-1]}'s ancestors {missing} were never fed")
            allowed[row, [self.length + self.fed[node] for node in path[1:]]] = True
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed,
                                                                   torch.finfo(dtype).min)
        positions = torch.tensor([self.length - 1 + len(path) - 1 for path in paths])
        return positions, mask[None, None]

    def renumber(self, new_ids: dict[int, int]) -> None:
        """Rename fed nodes (old id -> new id), forgetting those left out: a drafter that fed
        candidates and kept some of them as the tree (EAGLE-2's rerank) commits by tree ids."""
        self.fed = {new_ids[node]: entry for node, entry in self.fed.items() if node in new_ids}

    def commit(self, path: list[int]) -> int:
        """Keep the fed entries of the accepted `path` (root first; the root is committed
        already) and drop the rest of the tree; returns how many entries became committed.
        A path's fed nodes are a prefix of it: a node is fed only after its parent."""
        fed = []
        for node in path[1:]:
            if node not in self.fed:
                break
            fed.append(self.fed[node])
        keep_entries(self.cache, self.length, fed)
        self.length += len(fed)
        self.fed = {}
        return len(fed)


def with_own_engine(drafter):
    """A shallow copy of `drafter` (the same modules and settings) with its own empty
    DraftEngine: another sequence's drafter state, sharing the weights."""
    twin = copy.copy(drafter)
    twin.engine = DraftEngine(drafter.engine.config)
    return twin
