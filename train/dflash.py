"""DFlash's training objective on cached features: many blocks per sequence, one forward.

Per sequence, `anchors` positions a are sampled where the block's first draft is a token to
learn (a >= 1, learn[a + 1]). Block a is the query block [token a, MASK, ..., MASK] at
positions a .. a + b - 1 over the context of the target's fused features of every position;
drafters.dflash.block_mask lets it see only the context before a (what the verifier would have
handed over when token a is the root) and itself. Its row k (1-based) predicts token a + k,
learning p = softmax(target LM head(f^L_{a+k-1})) over the draft vocabulary; it counts where
a + k < T and learn[a + k], weighted exp(-(k - 1) / loss_decay) (the paper's gamma): the first
drafts decide acceptance, later ones only matter once those are accepted.

Anchors are sampled from the global CPU generator in training, which a checkpoint saves and
restores (train.checkpoint.training_state), so a resumed run draws the anchors the
uninterrupted one would have; in eval mode from a fixed seed, so held-out accuracy is
repeatable.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.dflash import DFlashConfig, DFlashDraft, block_inputs, block_mask
from drafters.vocab import copy_linear
from train.distributed import global_mean
from train.losses import RowLoss, row_counts

EVAL_SEED = 0  # the held-out anchors: the same every evaluation


class DFlashLoss(nn.Module):
    """The draft's loss on a batch of right-padded sequences.

    target_head: the target's LM head; its rows of the draft vocabulary are kept, frozen, to
    turn the cached last states (the last H columns of a feature row) into soft targets. The
    first F * H columns of a feature row are the draft's context (its `feature_layers`).
    row_loss: the per-row objective against p (optim.loss)."""

    def __init__(self, draft: DFlashDraft, target_head: nn.Module, config: DFlashConfig,
                 row_loss: RowLoss = RowLoss()):
        super().__init__()
        self.draft, self.config, self.row_loss = draft, config, row_loss
        self.target_head = copy_linear(target_head, draft.vocab_ids).requires_grad_(False)
        self.hidden = target_head.weight.shape[1]
        self.input_width = len(draft.feature_layers) * self.hidden

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, learn: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T); features (B, T, C) float; learn (B, T) bool, the tokens to learn.
        Returns the loss and counts (D, 4), D = block_size - 1: per draft position [rows,
        top-1 hits, top-5 hits, summed acceptance alpha] against the target's most likely
        draft-vocabulary token."""
        starts, valid = sample_anchors(learn, self.config.anchors, self._generator())
        logits = self.block_logits(input_ids, features, starts, valid)  # (B, A, D, V')
        rows = block_rows(learn, starts, valid, logits.shape[2])
        target_probs = self.soft_targets(features, starts, logits.shape[2])
        per_row, alpha = self.row_loss(target_probs, logits)
        weights = position_weights(logits.shape[2], self.config.loss_decay, logits.device)
        loss = global_mean((per_row * weights * rows).sum(), rows.sum())
        targets = target_probs.argmax(-1)
        counts = [row_counts(logits[:, :, k].detach(), targets[:, :, k], rows[:, :, k],
                             alpha[:, :, k]) for k in range(logits.shape[2])]
        return loss, torch.stack(counts)

    def block_logits(self, input_ids: torch.Tensor, features: torch.Tensor,
                     starts: torch.Tensor, valid: torch.Tensor,
                     previous: torch.Tensor | None = None) -> torch.Tensor:
        """The draft's float logits (B, A, D, V') of blocks anchored at `starts` (B, A), over
        the context of all T positions' features, in one forward (block_mask). `previous`
        (B, A, D): the token before each draft position (the root, then the drafts), which
        DSpark's Markov head reads (None: the sequence's own tokens); DFlash reads none."""
        return self.draft.logits(self.block_hidden(input_ids, features, starts, valid)).float()

    def chain_logits(self, input_ids: torch.Tensor, features: torch.Tensor,
                     starts: torch.Tensor, valid: torch.Tensor, drafted: torch.Tensor
                     ) -> torch.Tensor:
        """The draft's float logits (B, A, D, V') at the first D positions of the blocks
        anchored at the roots `starts` (B, A) that drafted the chains `drafted` (B, A, D)
        (Draft-OPD, train.opd): `block_logits` fed the chain as `previous` (the root, then
        the draft's own tokens; what DSpark's Markov head reads). Positions past a shorter
        chain repeat its last token: each is read by its own position's head alone, and cut."""
        roots = input_ids.gather(1, starts)
        chain = torch.cat([roots[..., None], drafted[..., :-1]], dim=-1)
        extra = self.draft.block_size - 1 - chain.shape[-1]
        previous = torch.cat([chain, drafted[..., -1:].expand(*drafted.shape[:2], extra)], dim=-1)
        logits = self.block_logits(input_ids, features, starts, valid, previous)
        return logits[:, :, :drafted.shape[-1]]

    def block_hidden(self, input_ids: torch.Tensor, features: torch.Tensor,
                     starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The draft's normed outputs (B, A, D, H) at the draft positions of blocks anchored
        at `starts` (B, A): what `block_logits` reads the logits from."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        context = self.draft.context(features[..., :self.input_width], positions)
        b = self.draft.block_size
        tokens, block_positions = block_inputs(input_ids.gather(1, starts), starts, b)
        mask = block_mask(starts, valid, length, b, torch.float32)
        hidden = self.draft(tokens, block_positions, context, mask)  # (B, A * b, H)
        return hidden.view(batch, starts.shape[1], b, -1)[:, :, 1:]

    @torch.no_grad()
    def soft_targets(self, features: torch.Tensor, starts: torch.Tensor, depth: int
                     ) -> torch.Tensor:
        """p (B, A, D, V'): the target's next-token distribution over the draft vocabulary
        at each draft position of the blocks anchored at `starts` (B, A), read from the
        cached last states (the last H columns of `features` (B, T, C))."""
        states = _at(features[..., -self.hidden:], starts, depth)
        return self.target_head(states.to(self.target_head.weight.dtype)).float().softmax(-1)

    def _generator(self) -> torch.Generator | None:
        """None (the global CPU generator, checkpointed) in training; a fixed seed in eval."""
        return None if self.training else torch.Generator().manual_seed(EVAL_SEED)


def sample_anchors(learn: torch.Tensor, anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `anchors` distinct anchor positions per sequence, uniformly among those a >= 1
    whose next token is one to learn (learn[a + 1]): starts (B, A) long, sorted, and valid
    (B, A) bool. A sequence with fewer such positions gets invalid blocks (start 0).
    Drawn on the CPU from `generator` (None: the global one), so any device draws the same."""
    batch, length = learn.shape
    eligible = torch.zeros_like(learn)
    eligible[:, 1:-1] = learn[:, 2:]
    scores = torch.rand(batch, max(length, anchors), generator=generator).to(learn.device)
    scores[:, :length] = scores[:, :length].masked_fill(~eligible, -1.0)
    scores[:, length:] = -1.0  # a sequence shorter than `anchors` has fewer blocks
    top = scores.topk(anchors, dim=1)
    valid = top.values >= 0
    starts = torch.where(valid, top.indices, 0).sort(dim=1)
    return starts.values, valid.gather(1, starts.indices)


def block_rows(learn: torch.Tensor, starts: torch.Tensor, valid: torch.Tensor, depth: int
               ) -> torch.Tensor:
    """(B, A, D) bool: row k (1-based) of block a counts where the block is valid, a + k < T
    and token a + k is one to learn."""
    predicted = starts[..., None] + torch.arange(1, depth + 1, device=starts.device)
    inside = predicted < learn.shape[1]
    learned = learn.gather(1, predicted.clamp_max(learn.shape[1] - 1).flatten(1))
    return valid[..., None] & inside & learned.view(predicted.shape)


def position_weights(depth: int, decay: float, device: torch.device) -> torch.Tensor:
    """(D,) exp(-(k - 1) / decay) for draft positions k = 1..D."""
    return torch.exp(-torch.arange(depth, device=device, dtype=torch.float32) / decay)


def _at(states: torch.Tensor, starts: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, A, D, H) of (B, T, H) `states` at positions a + k - 1 (clamped into the sequence),
    the target states whose next-token distributions rows k = 1..D of block a learn."""
    rows = starts[..., None] + torch.arange(depth, device=starts.device)
    rows = rows.clamp_max(states.shape[1] - 1).flatten(1)  # (B, A * D)
    picked = states.gather(1, rows[..., None].expand(-1, -1, states.shape[-1]))
    return picked.view(*starts.shape, depth, states.shape[-1])
