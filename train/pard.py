"""Training a PARD draft: every position also learns the k - 1 tokens after its next one, from
masks (An et al. 2025, arXiv 2504.18583), distilled from the target's cached last states.

The layout. A sequence of W tokens is extended with mask copies: query (t, g) is the real token
t for g = 0 and, for g = 1..k-1, the g-th mask after anchor t, at position t + g. Query (t, g)
sees the real tokens 0..t and the masks (t, 1..g) of its own anchor, nothing else: exactly what
mask g sees when drafting after root t (drafters.pard: causal attention over [context, root,
masks]). Query (t, g) learns the target's distribution of token t + g + 1 (its features at
t + g, over the draft vocabulary, as train.draft_model does for g = 0).

Conditional drop (PARD's COD, simply): offset g keeps a random share max(keep_ratio**g,
keep_min) of the W anchors, drawn among those kept at offset g - 1, so a kept mask's earlier
masks are always there to be seen. The draw is seeded by (seed, step): a resumed run sees the
layouts the uninterrupted one did.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from drafters.block import MASK
from drafters.draft_model import load_draft_model
from drafters.pard import PardConfig, PardDraft, mean_embedding, read_mask
from drafters.vocab import most_frequent_tokens
from train.distributed import global_mean
from train.draft_model import DistillLoss, divergence, initial_draft
from train.loop import hit_counts
from verify.runtime.model import Target


def block_layout(width: int, block_size: int, keep_ratio: float = 1.0, keep_min: float = 0.0,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries of a W-token sequence: anchors (N,) and offsets (N,) long, the W real tokens
    (offset 0) first, then each offset's kept masks (only those predicting a token < W)."""
    anchors, offsets = [torch.arange(width)], [torch.zeros(width, dtype=torch.long)]
    kept = torch.arange(width)
    for g in range(1, block_size):
        kept = kept[kept + g + 1 < width]
        count = math.ceil(width * max(keep_ratio ** g, keep_min))
        if count < len(kept):
            kept = kept[torch.randperm(len(kept), generator=generator)[:count]].sort().values
        anchors.append(kept)
        offsets.append(torch.full((len(kept),), g, dtype=torch.long))
    return torch.cat(anchors), torch.cat(offsets)


def layout_mask(anchors: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
    """(1, 1, N, N) additive attention mask: query (t, g) sees real tokens 0..t and the masks
    (t, 1..g); a real token (g = 0) is causal over the real tokens."""
    qa, qo, ka, ko = anchors[:, None], offsets[:, None], anchors[None], offsets[None]
    allowed = ((ko == 0) & (ka <= qa)) | ((ka == qa) & (ko >= 1) & (ko <= qo))
    mask = torch.zeros(allowed.shape, dtype=dtype, device=anchors.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class PardLoss(DistillLoss):
    """The draft's divergence from the target over every query of the layout, on a batch of
    right-padded sequences; built as DistillLoss is (draft: a PardDraft), target_head's rows of
    the draft vocabulary turning cached last states into the target's logits (frozen)."""

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, learn: torch.Tensor,
                anchors: torch.Tensor | None = None, offsets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, W); features (B, W, H) the target's last states; learn (B, W); the
        layout (block_layout; None: every query). Returns the mean divergence over counted
        queries and counts (k, 3) per offset: [rows, top-1 hits, top-5 hits]."""
        width, k = input_ids.shape[1], self.draft.block_size
        if anchors is None:
            anchors, offsets = (t.to(input_ids.device) for t in block_layout(width, k))
        tokens = torch.where(offsets == 0, input_ids[:, anchors], MASK)
        positions = (anchors + offsets).expand(len(input_ids), -1)
        mask = layout_mask(anchors, offsets, self.draft.mask_embedding.dtype)
        draft_logits = self.draft(tokens, positions, mask)  # (B, N, V')
        predicted = (anchors + offsets + 1).clamp_max(width - 1)  # the token each query learns
        rows = learn[:, predicted] & (anchors + offsets + 1 < width)
        with torch.no_grad():
            target_logits = self.target_head(features[:, predicted - 1].to(
                self.target_head.weight))
        per_row = divergence(target_logits, draft_logits, self.kind)
        loss = global_mean((per_row * rows).sum(), rows.sum())
        argmax, detached = target_logits.argmax(-1), draft_logits.detach().float()
        counts = [hit_counts(detached[:, offsets == g], argmax[:, offsets == g],
                             rows[:, offsets == g]) for g in range(k)]
        return loss, torch.stack(counts)


def with_layout(make_batch: Callable[[int], dict], config: PardConfig, seed: int
                ) -> Callable[[int], dict]:
    """make_batch(step) with the step's layout (conditional drop seeded by seed and step)."""
    def make(step: int) -> dict:
        batch = make_batch(step)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        ids = batch["input_ids"]
        anchors, offsets = block_layout(ids.shape[1], config.block_size, config.keep_ratio,
                                        config.keep_min, generator)
        return {**batch, "anchors": anchors.to(ids.device), "offsets": offsets.to(ids.device)}
    return make


def initial_pard(target: Target, config: PardConfig, learned_tokens
                 ) -> tuple[PardDraft, torch.Tensor | None]:
    """The draft before training and its vocabulary (V',) or None: the distilled draft in
    drafter.path (its vocabulary, and its mask when it is a PARD draft already), or the
    target's first layers (train.draft_model.initial_draft) over the `learned_tokens`' most
    frequent; the mask starts at the mean token embedding."""
    if config.path is None:
        vocab = most_frequent_tokens(learned_tokens, config.draft_vocab_size)
        model = initial_draft(target.model, config, vocab)
    else:
        loaded, vocab = load_draft_model(config.path, target, config.allow_other_target)
        model = copy.deepcopy(loaded).train()  # its own tensors: the target's table is frozen
        model.requires_grad_(True).get_input_embeddings().requires_grad_(False)
    saved = None if config.path is None else read_mask(config.path)
    mask = mean_embedding(model) if saved is None else saved[1]
    return PardDraft(model, config.block_size, vocab, mask).train(), vocab
