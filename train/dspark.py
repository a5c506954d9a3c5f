"""DSpark's training objective on cached features: DFlash's blocks (train.dflash) with the
Markov head teacher-forced and the paper's three terms.

Blocks are anchored as DFlash's (sample_anchors, block_mask); draft position k of the block
anchored at a reads the backbone's output there plus the Markov bias of the token before it,
x_{a + k - 1}: the sequence's own token in supervised training (the root for k = 1), or the
draft's own proposal when a caller passes `previous` (on-policy training). Per position, with
p the target's distribution and q the draft's over the draft vocabulary:

    ce_weight * CE(q, argmax p) + l1_weight * ||q - p||_1
        + confidence_weight * BCE(confidence, 1 - ||q - p||_1 / 2)

the last term teaching the confidence head the analytic acceptance min(p, q) summed (detached:
the head learns to predict the acceptance, not to move it). Positions weigh
exp(-(k - 1) / loss_decay), as DFlash's.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.dspark import DSparkConfig, DSparkDraft
from train.dflash import DFlashLoss, block_rows, position_weights, sample_anchors
from train.distributed import global_mean
from train.losses import row_counts


class DSparkLoss(DFlashLoss):
    """The draft's loss on a batch of right-padded sequences (DFlashLoss's inputs); the
    target's head rows of the draft vocabulary give p as in DFlash."""

    draft: DSparkDraft
    config: DSparkConfig

    def __init__(self, draft: DSparkDraft, target_head: nn.Module, config: DSparkConfig):
        super().__init__(draft, target_head, config)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, learn: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T); features (B, T, C); learn (B, T) bool. Returns the loss and
        counts (D, 4) per draft position: [rows, top-1 hits, top-5 hits, summed acceptance]
        against the target's most likely draft-vocabulary token, given the true prefix."""
        starts, valid = sample_anchors(learn, self.config.anchors, self._generator())
        depth = self.draft.block_size - 1
        hidden = self.block_hidden(input_ids, features, starts, valid)  # (B, A, D, H)
        previous = teacher_previous(input_ids, starts, depth)
        logits = self.markov_logits(hidden, previous)
        rows = block_rows(learn, starts, valid, depth)
        target_probs = self.soft_targets(features, starts, depth)
        per_row, accept = self.row_terms(hidden, previous, logits, target_probs)
        weights = position_weights(depth, self.config.loss_decay, logits.device)
        loss = global_mean((per_row * weights * rows).sum(), rows.sum())
        targets = target_probs.argmax(-1)
        counts = [row_counts(logits[:, :, k].detach(), targets[:, :, k], rows[:, :, k],
                             accept[:, :, k]) for k in range(depth)]
        return loss, torch.stack(counts)

    def block_logits(self, input_ids: torch.Tensor, features: torch.Tensor,
                     starts: torch.Tensor, valid: torch.Tensor,
                     previous: torch.Tensor | None = None) -> torch.Tensor:
        depth = self.draft.block_size - 1
        if previous is None:
            previous = teacher_previous(input_ids, starts, depth)
        return self.markov_logits(self.block_hidden(input_ids, features, starts, valid),
                                  previous)

    def markov_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """(B, A, D, H) backbone outputs and (B, A, D) previous tokens -> float (B, A, D, V')
        logits: the block's plus the Markov bias."""
        return (self.draft.logits(hidden) + self.draft.markov_bias(previous)).float()

    def row_terms(self, hidden: torch.Tensor, previous: torch.Tensor, logits: torch.Tensor,
                  target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position the weighted sum of the three terms (B, A, D), and the analytic
        acceptance 1 - ||q - p||_1 / 2 (B, A, D), detached."""
        config = self.config
        log_q = logits.log_softmax(-1)
        l1 = (log_q.exp() - target_probs).abs().sum(-1)
        ce = -log_q.gather(-1, target_probs.argmax(-1, keepdim=True))[..., 0]
        accept = (1 - l1 / 2).detach().clamp(0, 1)
        per_row = config.ce_weight * ce + config.l1_weight * l1
        if self.draft.confidence is not None and config.confidence_weight:
            confidence = self.draft.confidence_logits(hidden, previous).float()
            per_row = per_row + config.confidence_weight * \
                nn.functional.binary_cross_entropy_with_logits(confidence, accept,
                                                               reduction="none")
        return per_row, accept


def teacher_previous(input_ids: torch.Tensor, starts: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, A, D) the sequence's token before each draft position k = 1..D of the blocks
    anchored at `starts` (B, A): x_{a + k - 1}, the root first (clamped into the sequence;
    positions past it are left out of the loss by block_rows)."""
    positions = starts[..., None] + torch.arange(depth, device=starts.device)
    positions = positions.clamp_max(input_ids.shape[1] - 1)
    return input_ids.gather(1, positions.flatten(1)).view(positions.shape)
