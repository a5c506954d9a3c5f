"""Tree attention on any Hugging Face causal LM, through transformers' own extension points.

The verifier owns the target's KV cache for B sequences (rows) decoded together. A step runs
one token tree per row, padded to a common N nodes, as one forward: a float 4D attention mask
(B, 1, N, S + N) lets each node see its row's committed tokens plus its own ancestors, and
explicit position ids place each node at lengths[b] + depth. No modeling file is copied: this
is the public `attention_mask` / `position_ids` / `cache` interface of every causal LM.

Row b's committed tokens sit at cache slots 0 .. lengths[b] - 1. Slots beyond are stale (a
shorter prompt's padding, room left by a longer row) and every mask hides them. After
acceptance each row's path moves down to follow its committed tokens and the cache is trimmed
to the longest row, so memory stays bounded and positions stay contiguous. With B = 1 there
are no stale slots and the cached sequence is exactly the committed tokens. The layout and the
moves on it live in verify/cache.py (the draft engine's cache is laid out the same way).

Every step runs through the target's step (verify/step.py), which says what differs by kind:
the width a forward runs at (a packed target pads trees up to a packed row count), the cache
the steps run on and the columns every mask spans (a compiled step's room: (B, 1, N, C)), and
the graphs to compile before a decode. Prompts always run the eager model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from verify.cache import (
    cache_length,
    cache_rows_alone,
    keep_paths,
    new_cache,
    trim,
)
from verify.features import num_layers, resolve_layers, select_features
from verify.step import TargetStep, as_step
from verify.tree import TokenTree, TreeBatch


def context_window(model: PreTrainedModel) -> int | None:
    """Longest sequence (prompt + generated) the model's positions support, if it says.
    (GPT-2's config aliases max_position_embeddings to n_positions.)"""
    return getattr(model.config, "max_position_embeddings", None)


def tree_attention_mask(batch: TreeBatch, lengths: torch.Tensor, cache_size: int,
                        dtype: torch.dtype, columns: int | None = None) -> torch.Tensor:
    """(B, 1, N, cache_size + N) additive mask: 0 where a node may attend (its row's
    lengths[b] committed slots, its ancestors and itself), dtype-min elsewhere. With
    `columns`, (B, 1, N, columns): the slots past the tree are hidden too."""
    committed = torch.arange(cache_size)[None, None, :] < lengths[:, None, None]  # (B, 1, S)
    allowed = torch.cat([committed.expand(-1, batch.width, -1), batch.ancestors], dim=-1)
    if columns is not None:
        allowed = torch.nn.functional.pad(allowed, (0, columns - allowed.shape[-1]))
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class TreeVerifier:
    """Runs a target model over B growing sequences and token trees appended to them.

    The single-sequence methods (`prefill`, `verify`, `commit`, `step_inputs`, `length`) are the
    B = 1 case of the batch methods (`prefill_batch`, `verify_batch`, `commit_batch`).
    `model` is the target's step (`Target.step`) or a bare model, run through its eager step.
    """

    def __init__(self, model: PreTrainedModel | TargetStep, feature_layers: tuple[int, ...] = ()):
        self.step = as_step(model)
        self.model = self.step.model
        self.feature_layers = resolve_layers(feature_layers, num_layers(self.model.config))
        self.cache = new_cache(self.model.config)
        self.lengths = torch.zeros(1, dtype=torch.long)  # (B,) committed tokens per row
        self._tree_start = 0  # cache slot where the last verified trees begin

    @property
    def length(self) -> int:
        """Committed tokens of the only row (B = 1)."""
        if len(self.lengths) != 1:
            raise ValueError(f"`length` is for one sequence; this verifier has {len(self.lengths)}")
        return int(self.lengths[0])

    @property
    def cache_size(self) -> int:
        """Cache slots in use (the longest row's; not a room cache's capacity)."""
        return cache_length(self.cache)

    # -- one sequence -------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache the (T,) tokens after any already committed (B = 1); returns the last
        position's logits (V,) (float, CPU) and the features of all T positions (T, F * H),
        or None without feature layers."""
        if not self.cache_size:  # a new sequence: the batch of one
            logits, features = self.prefill_batch([input_ids])
            return logits[0].cpu(), None if features is None else features[0]
        if not self.step.extends_prompts:
            raise NotImplementedError(f"a {type(self.step).__name__}'s verifier prefills a new "
                                      "sequence only; this one has cached tokens already")
        positions = torch.arange(self.length, self.length + len(input_ids))
        logits, features = self._forward(input_ids[None], positions[None], None, logits_to_keep=1)
        self.lengths += len(input_ids)
        return logits[0, -1].cpu(), None if features is None else features[0]

    @torch.no_grad()
    def verify(self, tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run all N tree nodes at once (B = 1); returns logits (N, V) (float, CPU) and features
        (N, F * H) or None. Row i is what the target predicts after the path root..i. The
        tree's keys/values are appended to the cache until `commit` keeps the accepted path."""
        logits, features = self.verify_batch(TreeBatch.pad([tree]))
        return logits[0].cpu(), None if features is None else features[0]

    def step_inputs(self, tree: TokenTree
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """What `verify(tree)` feeds the model after the L cached tokens (B = 1): the (N',)
        tokens (N' >= N: padded on a packed target), the (1, 1, N', L + N') attention mask
        (None for a lone root: plain decoding needs none) and the (N',) position ids."""
        batch = self._step_width(TreeBatch.pad([tree]))
        mask, positions = self.batch_inputs(batch)
        return batch.tokens[0], mask, positions[0]

    def commit(self, path: list[int]) -> None:
        """Keep the cached keys/values of the accepted tree nodes `path` (root first) only."""
        self.commit_batch([path])

    # -- B sequences ----------------------------------------------------------------------------

    @torch.no_grad()
    def prefill_batch(self, prompts: Sequence[torch.Tensor]
                      ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Start B sequences from (T_b,) prompts. Returns each row's last logits (B, V)
        (float, on the model's device) and each row's features (T_b, F * H), or None.

        Each prompt runs alone, as `generate` would run it, and the rows' caches are then
        stacked (right-padded): one padded forward would pay for every row's padding, and
        Spec-Bench prompts of 40-770 tokens made a batch of 16 cost 12k tokens for 2.5k real
        ones (15 s of a 25 s batch here)."""
        if self.cache_size:
            raise ValueError("prefill_batch starts new sequences: this verifier already has some")
        logits, features = [None] * len(prompts), [None] * len(prompts)

        def run_row(row: int, cache: DynamicCache) -> None:
            prompt = prompts[row]
            row_logits, row_features = batched_forward(
                self.model, cache, prompt[None], torch.arange(len(prompt))[None],
                logits_to_keep=1, feature_layers=self.feature_layers)
            logits[row] = row_logits[0, -1]
            features[row] = None if row_features is None else row_features[0]

        self.cache = self.step.steps_cache(
            cache_rows_alone(self.model.config, len(prompts), run_row))
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return torch.stack(logits), None if features[0] is None else features

    @torch.no_grad()
    def verify_batch(self, batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every row's tree in one forward; returns logits (B, N, V) (float, on the model's
        device: acceptance picks the path there) and features (B, N, F * H) or None. Padding
        nodes' rows are meaningless."""
        if len(batch.tokens) != len(self.lengths):
            raise ValueError(f"{len(batch.tokens)} trees for {len(self.lengths)} sequences")
        width = batch.width
        batch = self._step_width(batch)
        self.step.make_room(self.cache, batch.width)
        mask, positions = self.batch_inputs(batch)
        self._tree_start = self.cache_size
        logits, features = self._forward(batch.tokens, positions, mask)
        return logits[:, :width], None if features is None else features[:, :width]

    def _step_width(self, batch: TreeBatch) -> TreeBatch:
        """`batch` padded to the width the step runs it at (`TargetStep.width_for`): on a
        packed target the next row count whose weights are packed, on a compiled step one
        row's at least its `min_width`; on an eager one `batch` itself."""
        return batch.widen(self.step.width_for(len(batch.tokens), batch.width))

    def compile_graphs(self, rows: int) -> None:
        """On a compiled step, compile the graphs that decoding `rows` sequences with these
        feature layers runs (a one-token step and a tree step) on a throwaway cache, unless
        they exist: compilation then happens here, before any decoding is timed, not in the
        middle of a decode. Nothing to do on an eager model."""
        rows = min(rows, 2)  # the rows are a symbol: two stand for any batch
        if self.step.has_graphs(rows, bool(self.feature_layers)):
            return
        scratch = TreeVerifier(self.step, self.feature_layers)
        scratch.prefill_batch([torch.zeros(1, dtype=torch.long)] * rows)
        for width in (1, 2):
            tree = TokenTree(torch.zeros(width, dtype=torch.long), torch.arange(width) - 1)
            scratch.verify_batch(TreeBatch.pad([tree] * rows))
            scratch.commit_batch([[]] * rows)

    def batch_inputs(self, batch: TreeBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The (B, 1, N, S + N) attention mask over the S cached slots and the trees (None
        when plain causal attention is the same: lone roots, no stale slots) and the (B, N)
        position ids. A step whose masks span more columns (a compiled step's room) always
        gets a mask of that many."""
        positions = self.lengths[:, None] + batch.depths
        size, columns = self.cache_size, self.step.mask_columns(self.cache)
        if columns is None and batch.width == 1 and bool((self.lengths == size).all()):
            return None, positions
        return tree_attention_mask(batch, self.lengths, size, self.model.dtype,
                                   columns), positions

    def commit_batch(self, paths: Sequence[Sequence[int]]) -> None:
        """Keep, in each row, the accepted nodes paths[b] (root first) of the last trees."""
        if len(paths) != len(self.lengths):
            raise ValueError(f"{len(paths)} paths for {len(self.lengths)} sequences")
        keep_paths(self.cache, self.lengths, self._tree_start, paths)
        self.lengths = self.lengths + torch.tensor([len(p) for p in paths], dtype=torch.long)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` (long indices, in the new order): finished rows leave
        the batch and the cache shrinks to the longest row left."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(rows.to(self.model.device))
        self.lengths = self.lengths[rows]
        trim(self.cache, int(self.lengths.max()) if len(rows) else 0)

    def _forward(self, tokens, positions, attention_mask, logits_to_keep=0):
        return batched_forward(self.model, self.cache, tokens, positions, attention_mask,
                               logits_to_keep, self.feature_layers, self.step)


def batched_forward(model: PreTrainedModel, cache: DynamicCache, tokens: torch.Tensor,
                    positions: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    logits_to_keep: int | torch.Tensor = 0, feature_layers: tuple[int, ...] = (),
                    step: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append (B, n) tokens at (B, n) positions to `cache` in one forward of `model`.

    attention_mask: None for causal attention, or an additive (B, 1, n, cached + n) mask
    ((B, 1, n, C) over a room cache's C slots).
    logits_to_keep: 0 for all positions, k > 0 for the last k, or a (k,) tensor of positions.
    step: what runs the forward instead of `model` (a TargetStep), same arguments.
    Returns float logits (B, n', V) on the model's device and, with feature_layers (absolute
    hidden-state indices, see verify.features), the features (B, n, F * H) on the model's
    device and in its dtype: drafters run there, so nothing is copied.
    """
    device = model.device
    if isinstance(logits_to_keep, torch.Tensor):
        logits_to_keep = logits_to_keep.to(device)
    out = (step or model)(
        input_ids=tokens.to(device),
        position_ids=positions.to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        cache=cache,
        use_cache=True,
        output_hidden_states=bool(feature_layers),
        logits_to_keep=logits_to_keep,
    )
    features = select_features(out.hidden_states, feature_layers) if feature_layers else None
    return out.logits.float(), features
