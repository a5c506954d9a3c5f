"""EAGLE's training objective (EAGLE-1 and EAGLE-3's training-time test), on cached features.

Row j of a sequence feeds the draft (feature f_j, token j + 1) and asks for what the target
computed at j + 1: its feature f^L_{j+1} (smooth-L1, EAGLE-1) and its next-token distribution
p_{j+1} = softmax(LM head(f^L_{j+1})) over the draft vocabulary (cross-entropy, both). Only rows
whose predicted token j + 2 is a token to learn (an assistant token) count.

Training-time test (EAGLE-3): at decoding time a depth-d node reads the draft's own output of
its parent, not a target feature. Step s of the unroll does exactly that: row j reads the step
s - 1 output of row j - 1 and attends to the real entries up to j - s (its chain's root) and to
its own chain's entries of steps 1..s, the tree mask a depth-s node sees. Its targets are
step 0's. Step s weighs step_decay ** s.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import DynamicCache

from drafters.eagle import EagleConfig, EagleDraft
from drafters.vocab import copy_linear
from train.distributed import global_mean
from train.losses import RowLoss, row_counts


class EagleLoss(nn.Module):
    """The draft's loss on a batch of right-padded sequences.

    target_head: the target's LM head rows of the draft vocabulary, frozen (soft targets).
    input_width: the first `input_width` columns of a feature row are the draft's input
    (F * H); the last H columns are the target's last normed state f^L.
    row_loss: the per-row objective against p (optim.loss; the soft cross-entropy by default).
    """

    def __init__(self, draft: EagleDraft, target_head: nn.Module, config: EagleConfig,
                 row_loss: RowLoss = RowLoss()):
        super().__init__()
        self.draft, self.config, self.row_loss = draft, config, row_loss
        self.target_head = copy_linear(target_head, draft.vocab_ids).requires_grad_(False)
        self.input_width = len(draft.feature_layers) * target_head.weight.shape[1]

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, learn: torch.Tensor,
                steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T); features (B, T, C) float; learn (B, T) bool, the tokens to learn
        (assistant tokens, not padding); steps: unrolled steps (default config.ttt_steps; the
        evaluation unrolls further). Returns the loss and counts (S, 4): per step [rows, top-1
        hits, top-5 hits] against the target's most likely draft-vocabulary token, and the
        summed acceptance alpha (train.losses)."""
        inputs, tokens, target_states, rows = self._rows(input_ids, features, learn)
        with torch.no_grad():
            target_probs = self.target_head(target_states).float().softmax(-1)  # (B, T-1, V')
        loss, counts = features.new_zeros((), dtype=torch.float32), []
        for step, hidden in enumerate(self.unroll(inputs, tokens, steps or self.config.ttt_steps)):
            valid = rows.clone()
            valid[:, :step] = False  # rows without a chain root `step` positions back
            step_loss, step_counts = self._step_loss(hidden, target_states, target_probs, valid)
            loss = loss + self.config.step_decay ** step * step_loss
            counts.append(step_counts)
        return loss, torch.stack(counts)

    def unroll(self, inputs: torch.Tensor, tokens: torch.Tensor, steps: int
               ) -> Iterator[torch.Tensor]:
        """The draft's predicted features (B, T, H) at steps 0..steps - 1: step 0 reads the
        target's fused features (B, T, H), step s the step s - 1 outputs one row down; row j
        always reads token (B, T) j + 1 and sits at position j."""
        return self.unroll_over(inputs, [tokens] * steps)

    def unroll_over(self, inputs: torch.Tensor, step_tokens: list[torch.Tensor]
                    ) -> Iterator[torch.Tensor]:
        """`unroll` with the tokens of each step given: step s's row j reads
        step_tokens[s][j] (B, T), one step per entry."""
        tokens = step_tokens[0]
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        cache = DynamicCache(config=self.draft.body.config) if len(step_tokens) > 1 else None
        hidden = None
        for step, tokens in enumerate(step_tokens):
            if step > 0:  # chain order: row j continues the chain row j - 1 was on
                inputs = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
            mask = ttt_mask(tokens.shape[1], step, inputs.dtype, inputs.device) if step else None
            hidden = self.draft(inputs, tokens, positions, mask, cache)
            yield hidden

    def chain_logits(self, input_ids: torch.Tensor, features: torch.Tensor,
                     starts: torch.Tensor, valid: torch.Tensor, drafted: torch.Tensor
                     ) -> torch.Tensor:
        """The draft's float logits (B, A, D, V') along the chains drafted (B, A, D) after
        the roots at `starts` (B, A) (Draft-OPD, train.opd), as decoding computed them: depth
        k of the chain rooted at r is step k - 1 of the unroll at row r + k - 2, which reads
        the drafted token d_{k-1} (the root's own at k = 1) on the depth k - 1 output. The
        context is the real features (B, T, C) up to r - 1, without training noise; rows past
        a sequence's end are padding a chain may run into. Invalid steps' logits are 0."""
        depth, width = drafted.shape[-1], self.input_width
        inputs = self.draft.fuse_features(features[:, :-1, :width])
        inputs = nn.functional.pad(inputs, (0, 0, 0, depth))  # (B, T - 1 + D, H)
        tokens = nn.functional.pad(input_ids[:, 1:], (0, depth))
        rows = torch.arange(len(input_ids), device=starts.device)[:, None].expand_as(starts)
        rows, roots, chains = rows[valid], starts[valid], drafted[valid]  # (N,), (N,), (N, D)
        step_tokens = [tokens]
        for step in range(1, depth):
            stepped = tokens.clone()
            stepped[rows, roots - 1 + step] = chains[:, step - 1]
            step_tokens.append(stepped)
        per_step = [self.draft.logits(hidden[rows, roots - 1 + step]).float()
                    for step, hidden in enumerate(self.unroll_over(inputs, step_tokens))]
        logits = per_step[0].new_zeros(*drafted.shape, per_step[0].shape[-1])
        logits[valid] = torch.stack(per_step, dim=1)  # (N, D, V')
        return logits

    def _rows(self, input_ids, features, learn):
        """Inputs (B, T-1, H) of rows 0..T-2, their next tokens (B, T-1), the target states
        f^L_{j+1} they predict (B, T-1, H), and which rows count (B, T-1)."""
        inputs = features[:, :-1, :self.input_width]
        if self.training and self.config.noise:
            inputs = inputs + torch.empty_like(inputs).uniform_(-self.config.noise,
                                                                self.config.noise)
        rows = torch.zeros_like(learn[:, 1:])
        rows[:, :-1] = learn[:, 2:]  # row j predicts token j + 2; the last row predicts nothing
        return (self.draft.fuse_features(inputs), input_ids[:, 1:],
                features[:, 1:, -self.target_head.weight.shape[1]:], rows)

    def _step_loss(self, hidden, target_states, target_probs, valid):
        logits = self.draft.logits(hidden).float()
        per_row, alpha = self.row_loss(target_probs, logits)
        loss = self.config.ce_weight * (per_row * valid).sum()
        if self.config.feature_weight:
            l1 = nn.functional.smooth_l1_loss(hidden.float(), target_states.float(),
                                              reduction="none").mean(-1)
            loss = loss + self.config.feature_weight * (l1 * valid).sum()
        loss = global_mean(loss, valid.sum())  # torchrun: over the global batch
        return loss, row_counts(logits.detach(), target_probs.argmax(-1), valid, alpha)


def ttt_mask(length: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask (1, 1, T, (step + 1) * T) for unrolled step `step` over a cache holding
    steps 0..step - 1: row j sees real entries 0..j - step and, for s = 1..step, the step-s
    entry of its own chain, row j - step + s. Rows j < step have no chain: they see only their
    own entry (so attention stays finite) and are left out of the loss."""
    rows = torch.arange(length, device=device)
    allowed = torch.zeros(length, (step + 1) * length, dtype=torch.bool, device=device)
    allowed[:, :length] = rows[None, :] <= (rows[:, None] - step)
    for s in range(1, step + 1):
        allowed[rows, s * length + (rows - step + s).clamp_min(0)] = True
    allowed[rows, step * length + rows] = True
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
