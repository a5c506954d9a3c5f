"""The draft engine on OpenVINO's kernels (`drafter.step=openvino`): drafters.engine's
bookkeeping over a paged cache (verify.runtime.openvino_step.PagedState) and a draft graph
built from the draft's own weights (drafters.paged_drafts).

Why a second engine and not a second cache: PagedAttention lets a forward's new tokens see
every cached slot of their row and masks only among the new ones (`qq_bias`). A tree level
appended after the last one would see its cousins. So each level re-feeds the row's tree so
far (the earlier levels' nodes with the inputs they were fed) after the committed slots, each
node seeing its ancestors only: a few more rows per forward, which on a one- or two-layer
draft cost far less than the forward's fixed price (the head and the weights read once).

Layout as drafters.engine's: row b's committed entries at slots 0 .. lengths[b] - 1, its
current tree's fed nodes after them in feed order (the slot a node keeps while its tree
grows); a node at depth d sits at position lengths[b] - 1 + d.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import openvino as ov
import torch

from drafters.engine import RowLengths, fed_prefix
from verify.runtime.openvino_step import PagedState

# A row's level answer: the states its new nodes predict (n, H) or None, and their float
# draft-vocabulary logits (n, V'); as drafters.engine.LevelAnswer.
Answer = tuple[torch.Tensor | None, torch.Tensor]


class FedNode(NamedTuple):
    """A tree node in the draft's cache: its id (-1 once renumbering dropped it), its path
    (node ids, root first), its token and the input state it was fed with (H,) or None."""

    node: int
    path: tuple[int, ...]
    token: int
    state: torch.Tensor | None


class PagedDraftEngine(RowLengths):
    """B rows of draft cache on a compiled draft graph: inputs as verify.runtime.openvino_graph's,
    plus `draft_states` (rows, H') for a draft that reads states (EAGLE's inputs, DFlash's context
    features); outputs `logits` (R, V') and, for a draft that predicts states, `hidden` (R, H) at
    the logit rows."""

    def __init__(self, compiled: ov.CompiledModel, rotary: torch.nn.Module, dtype: torch.dtype):
        self.compiled, self.rotary, self.dtype = compiled, rotary, dtype
        names = [set(port.get_names()) for port in (*compiled.inputs, *compiled.outputs)]
        self.reads_states = any("draft_states" in n for n in names)
        self.returns_states = any("hidden" in n for n in names)
        self.state = PagedState(compiled, rotary, dtype)
        self.forwards = 0  # draft forwards run (catch-ups and tree levels), for cost reports
        self.reset()

    def empty_copy(self) -> PagedDraftEngine:
        """The same compiled graph, a cache of its own (a forked drafter's)."""
        return PagedDraftEngine(self.compiled, self.rotary, self.dtype)

    def reset(self, rows: int = 1) -> None:
        """Forget everything: `rows` new sequences start."""
        self.state.reset_rows(rows)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.fed: list[list[FedNode]] = [[] for _ in range(rows)]

    @property
    def size(self) -> int:
        """Cache slots in use (committed and fed)."""
        return max((int(n) + len(fed) for n, fed in zip(self.lengths, self.fed)), default=0)

    def cache_bytes(self) -> int:
        """Bytes of key and value memory the draft's block pools hold now."""
        return sum(tensor.byte_size for tensor in self.state.blocks.values())

    def crop_rows(self, lengths: Sequence[int]) -> None:
        """Keep row b's first lengths[b] committed entries only (drops every tree too)."""
        self.lengths = self._cropped(lengths)
        self.rollback()

    def rollback(self) -> None:
        """Drop the trees' entries (their slots are overwritten later), keep the committed."""
        self.fed = [[] for _ in range(self.rows)]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` (long indices, in the new order)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        self.lengths = self.lengths[rows]
        self.state.keep_rows(rows, self.lengths)
        self.rollback()

    def feed_chains(self, tokens: Sequence[torch.Tensor],
                    states: Sequence[torch.Tensor] | None = None, outputs: int = 1) -> Answer:
        """Append tokens[b] (k_b,) to row b's committed entries, each seeing its row's earlier
        ones (a catch-up; `states[b]` (k_b, H) their input states). Returns the states
        (B * outputs, H) or None and the logits (B * outputs, V') at each row's last `outputs`
        tokens (PARD's block: its root and masks)."""
        counts = [len(row_tokens) for row_tokens in tokens]
        if min(counts) < outputs:
            raise ValueError(f"every row feeds at least {outputs} tokens, got {counts}")
        masks = [np.tril(np.ones((n, n), dtype=np.uint8)) for n in counts]
        return self.feed(tokens, masks, [np.arange(n - outputs, n) for n in counts], states)

    def feed(self, tokens: Sequence[torch.Tensor], masks: Sequence[np.ndarray],
             outputs: Sequence[np.ndarray], states: Sequence[torch.Tensor] | None = None
             ) -> Answer:
        """Append tokens[b] (k_b,) to row b's committed entries at its next positions, each
        seeing its row's committed entries and what masks[b] (k_b, k_b) allows among the new;
        `states[b]` the rows' draft_states. Returns the states or None and the logits at the
        rows outputs[b] (indices into tokens[b]) of every row, end to end."""
        counts = [len(row_tokens) for row_tokens in tokens]
        starts = np.cumsum([0, *counts[:-1]])
        rows = np.concatenate([start + np.asarray(row) for start, row in zip(starts, outputs)])
        self.rollback()
        self.forwards += 1
        answer = self._run(range(self.rows), torch.cat(list(tokens)), states,
                           [torch.arange(n) for n in counts], list(masks), rows)
        self.lengths = self.lengths + torch.tensor(counts)
        return answer

    def feed_level(self, levels: dict[int, tuple[list[list[int]], list[int],
                                                 torch.Tensor | None]]) -> dict[int, Answer]:
        """Feed, per asking row b, the nodes ending levels[b]'s paths (root first), with their
        tokens and input states (n_b, H) or None, in one forward that re-feeds each row's
        earlier levels (module docstring). Returns each asking row's answer for its new
        nodes. Every ancestor below the root must have been fed by an earlier level."""
        if not levels:
            return {}
        self.forwards += 1
        rows, nodes, masks, new_rows, starts = list(levels), [], [], [], 0
        for row in rows:
            fed = self._register(row, *levels[row])
            index = {node.node: column for column, node in enumerate(fed)}
            ancestors = np.zeros((len(fed), len(fed)), dtype=np.uint8)
            for column, node in enumerate(fed):
                ancestors[column, [index[n] for n in node.path[1:] if n in index]] = 1
            masks.append(ancestors)
            new_rows.append(starts + np.arange(len(fed) - len(levels[row][0]), len(fed)))
            starts += len(fed)
            nodes += fed
        states = [torch.stack([n.state for n in nodes])] if self.reads_states else None
        hidden, logits = self._run(
            rows, torch.tensor([n.token for n in nodes]), states,
            [torch.tensor([len(n.path) - 2 for n in self.fed[row]]) for row in rows],
            masks, np.concatenate(new_rows))
        sizes = [len(levels[row][0]) for row in rows]
        hidden = [None] * len(rows) if hidden is None else hidden.split(sizes)
        return dict(zip(rows, zip(hidden, logits.split(sizes))))

    def _register(self, row: int, paths: list[list[int]], tokens: list[int],
                  states: torch.Tensor | None) -> list[FedNode]:
        """Append the new nodes to row's fed list, checking each is new and its ancestors were
        fed; returns the list."""
        fed = self.fed[row]
        known = {node.node for node in fed}
        for column, (path, token) in enumerate(zip(paths, tokens)):
            if path[-1] in known:
                raise ValueError(f"node {path[-1]} was fed already")
            missing = [node for node in path[1:-1] if node not in known]
            if missing:
                raise ValueError(f"node {path[-1]}'s ancestors {missing} were never fed")
            fed.append(FedNode(path[-1], tuple(path), token,
                               None if states is None else states[column]))
            known.add(path[-1])
        return fed

    def _run(self, rows: Sequence[int], tokens: torch.Tensor,
             states: Sequence[torch.Tensor] | None, offsets: list[torch.Tensor],
             masks: list[np.ndarray], logit_rows: np.ndarray
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One forward of the draft graph (PagedState.infer): the logit rows' states and
        float logits."""
        extra = None
        if self.reads_states:
            extra = {"draft_states": torch.cat(list(states)).float().numpy()}
        self.state.infer(rows, tokens, [int(self.lengths[row]) for row in rows], offsets,
                         masks, logit_rows, extra)
        request = self.state.request
        logits = torch.from_numpy(request.get_tensor("logits").data.copy())
        if not self.returns_states:
            return None, logits
        return torch.from_numpy(request.get_tensor("hidden").data.copy()).to(self.dtype), logits

    def renumber(self, new_ids: dict[int, int], row: int = 0) -> None:
        """Rename row `row`'s fed nodes (old id -> new id); those left out stay in their slots
        as -1, never committed (EAGLE-2's rerank keeps some candidates as the tree)."""
        self.fed[row] = [node._replace(node=new_ids.get(node.node, -1)) for node in self.fed[row]]

    def commit(self, paths: Sequence[Sequence[int]]) -> list[int]:
        """Keep, per row, the fed entries of the accepted paths[b] (root first, committed
        already): the path's fed prefix moves down to the committed slots; the rest of the
        trees is dropped. Returns how many entries each row committed."""
        moves = [fed_prefix({node.node: offset for offset, node in enumerate(fed)
                             if node.node >= 0}, path)
                 for fed, path in zip(self.fed, paths, strict=True)]
        self.state.keep_paths(self.lengths, moves)
        counts = [len(offsets) for offsets in moves]
        self.lengths = self.lengths + torch.tensor(counts, dtype=torch.long)
        self.rollback()
        return counts
