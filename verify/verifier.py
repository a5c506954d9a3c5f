"""Tree attention on any Hugging Face causal LM, through transformers' own extension points.

The verifier owns the target's KV cache. A tree of N nodes is run as one forward pass: a float
4D attention mask (1, 1, N, L + N) lets each node see the L cached tokens plus its own ancestors,
and explicit position ids place each node at L + depth. No modeling file is copied: this is
the public `attention_mask` / `position_ids` / `cache` interface of every causal LM.

After acceptance the cache is compacted to the accepted path, so the cached sequence is always
exactly the committed tokens (memory stays bounded; positions stay contiguous).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from verify.features import num_layers, resolve_layers, select_features
from verify.tree import TokenTree


def context_window(model: PreTrainedModel) -> int | None:
    """Longest sequence (prompt + generated) the model's positions support, if it says.
    (GPT-2's config aliases max_position_embeddings to n_positions.)"""
    return getattr(model.config, "max_position_embeddings", None)


class TreeVerifier:
    """Runs a target model over a growing sequence and token trees appended to it."""

    def __init__(self, model: PreTrainedModel, feature_layers: tuple[int, ...] = ()):
        self.model = model
        self.feature_layers = resolve_layers(feature_layers, num_layers(model.config))
        self.cache = DynamicCache(config=model.config)
        self.length = 0  # tokens whose keys/values are cached (all committed)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache the (T,) tokens; returns the last position's logits (V,) and the features of
        all T positions (T, F * H), or None without feature layers."""
        positions = torch.arange(self.length, self.length + len(input_ids))
        logits, features = self._forward(input_ids, positions, None, logits_to_keep=1)
        self.length += len(input_ids)
        return logits[-1], features

    @torch.no_grad()
    def verify(self, tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run all N tree nodes at once; returns logits (N, V) and features (N, F * H) or None.

        Row i is what the target predicts after the path root..i. The tree's keys/values are
        appended to the cache until `commit` keeps the accepted path.
        """
        mask, positions = self.step_inputs(tree)
        return self._forward(tree.tokens, positions, mask)

    def step_inputs(self, tree: TokenTree) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The (1, 1, N, L + N) attention mask (None for a lone root: plain decoding needs
        none) and (N,) position ids of `tree` after the L cached tokens."""
        mask = self.tree_mask(tree, self.length, self.model.dtype) if len(tree) > 1 else None
        return mask, tree.position_ids(self.length)

    def commit(self, path: list[int]) -> None:
        """Keep the cached keys/values of the accepted tree nodes `path` (root first) only."""
        keep_entries(self.cache, self.length, path)
        self.length += len(path)

    @staticmethod
    def tree_mask(tree: TokenTree, cached: int, dtype: torch.dtype) -> torch.Tensor:
        """(1, 1, N, cached + N) additive mask: 0 where a node may attend, dtype-min elsewhere."""
        allowed = torch.cat([torch.ones(len(tree), cached, dtype=torch.bool),
                             tree.ancestor_mask()], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 attention_mask: torch.Tensor | None,
                 logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        return cached_forward(self.model, self.cache, tokens, positions, attention_mask,
                              logits_to_keep, self.feature_layers)


def keep_entries(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Compact `cache` to its first `start` entries followed by entries start + keep[i].

    A `keep` that is a prefix of the order (chains, the root alone) is already in place;
    otherwise its entries move down. Either way each layer becomes a view: the next forward's
    concatenation copies it anyway, so no extra full copy happens here.
    """
    index = torch.tensor(keep, dtype=torch.long) + start
    new_length = start + len(keep)
    in_place = list(keep) == list(range(len(keep)))
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"cache compaction supports full-attention layers, not {type(layer).__name__}")
        if not in_place:
            moved = index.to(layer.keys.device)
            layer.keys[..., start:new_length, :] = layer.keys.index_select(-2, moved)
            layer.values[..., start:new_length, :] = layer.values.index_select(-2, moved)
        layer.keys = layer.keys[..., :new_length, :]
        layer.values = layer.values[..., :new_length, :]


def cached_forward(model: PreTrainedModel, cache: DynamicCache, tokens: torch.Tensor,
                   positions: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   logits_to_keep: int = 0, feature_layers: tuple[int, ...] = ()
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append (n,) tokens at (n,) positions to `cache` in one forward of `model`.

    attention_mask: None for causal attention, or an additive (1, 1, n, cached + n) mask.
    Returns float CPU logits (n, V) (the last `logits_to_keep` rows when > 0) and, with
    feature_layers (absolute hidden-state indices, see verify.features), the features
    (n, F * H) on the model's device and in its dtype: drafters run there, so nothing is copied.
    """
    device = model.device
    out = model(
        input_ids=tokens[None].to(device),
        position_ids=positions[None].to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        cache=cache,
        use_cache=True,
        output_hidden_states=bool(feature_layers),
        logits_to_keep=logits_to_keep,
    )
    features = select_features(out.hidden_states, feature_layers)[0] if feature_layers else None
    return out.logits[0].float().cpu(), features
