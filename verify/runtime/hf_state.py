"""A Hugging Face model's KV cache for B rows, and the forwards over it: the state a
`TreeVerifier` keeps on an eager, packed or compiled step (verify/runtime/step.py).

Row b's committed tokens sit at cache slots 0 .. lengths[b] - 1. Slots beyond are stale (a
shorter prompt's padding, room left by a longer row) and every mask hides them. After
acceptance each row's path moves down to follow its committed tokens and the cache is trimmed
to the longest row, so memory stays bounded and positions stay contiguous. With B = 1 there
are no stale slots and the cached sequence is exactly the committed tokens. The layout and the
moves on it live in verify/runtime/cache.py (the draft engine's cache is laid out the same way).

A step runs one token tree per row, padded to a common N nodes, as one forward: a float 4D
attention mask (B, 1, N, S + N) lets each node see its row's committed tokens plus its own
ancestors, and explicit position ids place each node at lengths[b] + depth. No modeling file
is copied: this is the public `attention_mask` / `position_ids` / `cache` interface of every
causal LM. Prompts always run the eager model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from verify.runtime.cache import cache_length, cache_rows_alone, keep_paths, new_cache, trim
from verify.runtime.features import select_features
from verify.tree import TreeBatch


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


class CacheState:
    """The cache of a step that runs the model's own forward (`step`: eager, packed or
    compiled), with the feature layers (absolute hidden-state indices) every forward returns.
    The methods are `verify.runtime.step.StepState`'s."""

    def __init__(self, step, feature_layers: tuple[int, ...]):
        self.step = step
        self.model: PreTrainedModel = step.model
        self.feature_layers = feature_layers
        self.cache = new_cache(self.model.config)
        self._tree_start = 0  # cache slot where the last verified trees begin

    def size(self) -> int:
        """Cache slots in use (the longest row's; not a room cache's capacity)."""
        return cache_length(self.cache)

    def prefill_rows(self, prompts: Sequence[torch.Tensor]
                     ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Each (T_b,) prompt runs alone, as `generate` would run it, and the rows' caches are
        then stacked (right-padded): one padded forward would pay for every row's padding
        (Spec-Bench prompts of 40-770 tokens made a batch of 16 cost 12k tokens for 2.5k real
        ones here). Returns the last logits (B, V) and each row's (T_b, F * H) features."""
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
        return torch.stack(logits), None if features[0] is None else features

    def extend(self, tokens: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append (T,) tokens after the `length` committed ones of the only row: the last
        logits (V,) and the features (T, F * H) or None."""
        positions = torch.arange(length, length + len(tokens))
        logits, features = self._forward(tokens[None], positions[None], None, logits_to_keep=1)
        return logits[0, -1], None if features is None else features[0]

    def run_trees(self, batch: TreeBatch, lengths: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's tree in one forward: logits (B, N, V) and features (B, N, F * H)."""
        self.step.make_room(self.cache, batch.width)
        mask, positions = self.batch_inputs(batch, lengths)
        self._tree_start = self.size()
        return self._forward(batch.tokens, positions, mask)

    def batch_inputs(self, batch: TreeBatch, lengths: torch.Tensor
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The (B, 1, N, S + N) attention mask over the S cached slots and the trees (None
        when plain causal attention is the same: lone roots, no stale slots) and the (B, N)
        position ids. A step whose masks span more columns (a compiled step's room) always
        gets a mask of that many."""
        positions = lengths[:, None] + batch.depths
        size, columns = self.size(), self.step.mask_columns(self.cache)
        if columns is None and batch.width == 1 and bool((lengths == size).all()):
            return None, positions
        return tree_attention_mask(batch, lengths, size, self.model.dtype, columns), positions

    def keep_paths(self, lengths: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Keep, in each row, the accepted nodes paths[b] (root first) of the last trees."""
        keep_paths(self.cache, lengths, self._tree_start, paths)

    def keep_rows(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Keep the rows `rows` (in the new order), whose lengths are `lengths` now."""
        self.cache.batch_select_indices(rows.to(self.model.device))
        trim(self.cache, int(lengths.max()) if len(rows) else 0)

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
    hidden-state indices, see verify.runtime.features), the features (B, n, F * H) on the model's
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
