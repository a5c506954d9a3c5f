"""The feature contract: which of the target's hidden states a drafter reads.

A drafter declares `feature_layers`, indices into the tuple Hugging Face models return with
`output_hidden_states=True`: 0 is the token embeddings, i (1 <= i < L) the output of decoder
layer i, and L (or -1) the last layer's normed output, the state the LM head reads. Medusa and
EAGLE-1 read (-1,); EAGLE-3 reads a low, a middle and a high layer. Decoding (the verifier) and
training (feature extraction) both go through `select_features`, so a drafter sees the same
rows in both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAST = (-1,)  # the state the LM head reads


def num_layers(config) -> int:
    """Decoder layers of a model config (GPT-2's n_layer is aliased to num_hidden_layers)."""
    return int(config.num_hidden_layers)


def resolve_layers(layers: Sequence[int], total: int) -> tuple[int, ...]:
    """Feature layer indices made absolute for a model of `total` decoder layers (hidden
    states 0..total); ValueError for one out of range."""
    resolved = []
    for layer in layers:
        absolute = layer + total + 1 if layer < 0 else layer
        if not 0 <= absolute <= total:
            raise ValueError(f"feature layer {layer} does not exist in a model of {total} "
                             f"layers (hidden states 0..{total}, or -1 for the last)")
        resolved.append(absolute)
    return tuple(resolved)


def eagle3_layers(total: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers: the outputs of decoder layers 1, L/2 - 1 and
    L - 4 (0-based, as EAGLE's and SpecForge's code pick them), i.e. hidden states 2, L/2 and
    L - 3; clamped into 1..L for shallow models."""
    return tuple(min(max(i, 1), total) for i in (2, total // 2, total - 3))


def select_features(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The declared layers of a model's hidden states (each (..., T, H)), concatenated in
    declared order: (..., T, F * H). With one layer this is that layer's state itself."""
    if not layers:
        raise ValueError("no feature layers to select")
    picked = [hidden_states[layer] for layer in layers]
    return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
