"""Draft-OPD's objective (On-Policy Distillation for speculative draft models, arXiv
2605.29343): a trained draft learns from the target's feedback on the states its own drafting
put it in (rollouts: train.rollout).

A rollout step drafted the chain d_1..d_C after the root at position r, and the target
accepted its first a tokens. The draft run along that chain gives q_k at draft positions
k = 1..C, each conditioned on the drafted prefix as decoding conditioned it (the supervised
objective's `chain_logits`: a block draft's block anchored at r fed [root, d_1, .., d_{C-1}]
as `previous`, which DSpark's Markov head reads; an EAGLE draft unrolled along the chain, depth
k reading d_{k-1} on its own depth k - 1 output). The target's p_k is its LM head over the
draft vocabulary (the frozen rows `target_head`) at the state before position k: the root's
for k = 1, drafted node d_{k-1}'s after, so conditioned on the drafted prefix, rejected tokens
included.

- accepted positions (k <= a): forward KL(p_k || q_k), weighted forward_kl_weight: where the
  draft's own prefix was right, match the target's whole distribution (SFT's soft
  cross-entropy up to p's entropy, on on-policy states);
- rejected positions (k > a): reverse KL(q_k || p_k), weighted reverse_kl_weight *
  reject_decay ** (k - a - 1): mode-seeking, it pushes down the mass the draft put where the
  target puts little. The first rejected position (k = a + 1, the one that cost the step its
  tokens; its prefix is all accepted) weighs 1; each later one, whose prefix holds the rejected
  token and so is a state decoding never continues from, weighs reject_decay times the one
  before (0: the first rejected position alone; 1: every rejected position alike).

The loss is the sum of both parts over the batch's drafted positions divided by their number
(valid steps x C): the two parts add up to it, and a step's weight does not depend on how many
of its positions were accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from train.distributed import global_mean
from train.loop import hit_counts


@dataclass(frozen=True)
class OpdWeights:
    """opd.forward_kl_weight, opd.reverse_kl_weight and opd.reject_decay (train.schema)."""

    forward_kl: float = 1.0
    reverse_kl: float = 1.0
    reject_decay: float = 0.5

    @staticmethod
    def from_config(opd) -> OpdWeights:
        return OpdWeights(float(opd.forward_kl_weight), float(opd.reverse_kl_weight),
                          float(opd.reject_decay))


def position_weights(accepted: torch.Tensor, depth: int, weights: OpdWeights
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted (B, A) long, a per step -> (forward, reverse) weights (B, A, D) float of draft
    positions k = 1..D: forward_kl where k <= a, else 0; reverse_kl * reject_decay **
    (k - a - 1) where k > a, else 0."""
    k = torch.arange(1, depth + 1, device=accepted.device)
    a = accepted[..., None]
    forward = (k <= a).float() * weights.forward_kl
    after = (k - a - 1).clamp_min(0).float()  # rejected positions after the first
    decay = torch.full_like(after, weights.reject_decay).pow(after)  # 0 ** 0 == 1
    reverse = torch.where(k > a, decay * weights.reverse_kl, 0.0)
    return forward, reverse


def forward_kl(target_logp: torch.Tensor, draft_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) (...) of (..., V') log-probabilities, the target's p and the draft's q."""
    return (target_logp.exp() * (target_logp - draft_logp)).sum(-1)


def reverse_kl(target_logp: torch.Tensor, draft_logp: torch.Tensor) -> torch.Tensor:
    """KL(q || p) (...) of (..., V') log-probabilities, the target's p and the draft's q."""
    return (draft_logp.exp() * (draft_logp - target_logp)).sum(-1)


def opd_loss(draft_logits: torch.Tensor, target_logp: torch.Tensor, accepted: torch.Tensor,
             valid: torch.Tensor, weights: OpdWeights
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Draft-OPD's loss over a batch of rollout steps (the module's docstring).

    draft_logits (B, A, D, V') float, the draft along the steps' chains; target_logp
    (B, A, D, V') the target's log-probabilities at the same positions; accepted (B, A) long,
    a per step (0..D); valid (B, A) bool, the steps that count. Returns the loss and its parts,
    summed over the positions (detached): forward_kl and reverse_kl (weighted, as in the loss)
    and positions, the divisor (valid steps x D)."""
    depth = draft_logits.shape[2]
    draft_logp = draft_logits.log_softmax(-1)
    forward_w, reverse_w = position_weights(accepted, depth, weights)
    counted = valid[..., None].float()
    forward = (forward_kl(target_logp, draft_logp) * forward_w * counted).sum()
    reverse = (reverse_kl(target_logp, draft_logp) * reverse_w * counted).sum()
    positions = counted.sum() * depth
    loss = global_mean(forward + reverse, positions)
    return loss, {"forward_kl": forward.detach(), "reverse_kl": reverse.detach(),
                  "positions": positions}


def acceptance_counts(draft_logits: torch.Tensor, target_logp: torch.Tensor,
                      accepted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(D, 4) per draft position k: [steps that reached it (a >= k - 1), the draft's top-1 /
    top-5 hits on the target's most likely token there, steps that accepted it (a >= k)]; the
    training loop logs hits / steps as position{k-1}/top1 and accepted / steps as
    position{k-1}/alpha: the rollouts' acceptance at depth k given depth k - 1's."""
    depth = draft_logits.shape[2]
    k = torch.arange(1, depth + 1, device=accepted.device)
    reached = valid[..., None] & (accepted[..., None] >= k - 1)  # (B, A, D)
    taken = reached & (accepted[..., None] >= k)
    targets = target_logp.argmax(-1)
    return torch.stack([torch.cat([hit_counts(draft_logits[:, :, d].detach(), targets[:, :, d],
                                              reached[:, :, d]),
                                   taken[:, :, d].sum()[None].float()])
                        for d in range(depth)])


class RolloutStats:
    """What the rollouts did since the last `take()`: steps, their tau (mean a + 1, the tokens
    a target forward gave), acceptance by depth, and the loss parts per drafted position."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps, self.tokens, self.positions = 0, 0, 0.0
        self.forward_kl, self.reverse_kl = 0.0, 0.0
        self.accepted_at: list[int] = []

    def add(self, accepted: torch.Tensor, valid: torch.Tensor, depth: int,
            parts: dict[str, torch.Tensor]) -> None:
        """accepted, valid (B, A) of a batch, its draft depth D and opd_loss's parts."""
        a = accepted[valid]
        self.steps += len(a)
        self.tokens += int((a + 1).sum())
        at = [int((a >= k).sum()) for k in range(1, depth + 1)]
        self.accepted_at = [x + y for x, y in zip(self.accepted_at, at)] or at
        self.positions += float(parts["positions"])
        self.forward_kl += float(parts["forward_kl"])
        self.reverse_kl += float(parts["reverse_kl"])

    def take(self) -> dict:
        """{steps, tau, acceptance (by depth: the share of steps accepting it), forward_kl,
        reverse_kl (per drafted position, as in the loss)}, then reset."""
        steps, positions = max(self.steps, 1), max(self.positions, 1.0)
        summary = {"steps": self.steps, "tau": self.tokens / steps,
                   "acceptance": [x / steps for x in self.accepted_at],
                   "forward_kl": self.forward_kl / positions,
                   "reverse_kl": self.reverse_kl / positions}
        self.reset()
        return summary


class OnPolicyLoss(nn.Module):
    """Draft-OPD's objective on a batch of rollouts (train.rollout.rollout_batch).

    `objective` is the drafter's supervised objective (train.dflash.DFlashLoss, DSpark's
    subclass, train.eagle.EagleLoss), whose `chain_logits` run the draft along its drafted
    chains and whose frozen `target_head` turns the target's last states into p over the
    draft vocabulary. `window` and `run` gather RolloutStats: since the last learning-curve
    row, and over this process's steps."""

    def __init__(self, objective: nn.Module, weights: OpdWeights):
        super().__init__()
        self.objective, self.weights = objective, weights
        self.window, self.run = RolloutStats(), RolloutStats()

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, learn: torch.Tensor,
                starts: torch.Tensor, valid: torch.Tensor, drafted: torch.Tensor,
                accepted: torch.Tensor, target_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T), features (B, T, C') the context; learn (B, T) the decoded tokens
        (counted by a learning curve, not here); starts, valid, accepted (B, A); drafted
        (B, A, D) the chains; target_states (B, A, D, H). Returns the loss and counts (D, 4)
        (acceptance_counts)."""
        depth = drafted.shape[-1]
        logits = self.objective.chain_logits(input_ids, features, starts, valid, drafted)
        with torch.no_grad():
            head = self.objective.target_head
            target_logp = head(target_states.to(head.weight.dtype)).float().log_softmax(-1)
        loss, parts = opd_loss(logits, target_logp, accepted, valid, self.weights)
        for stats in (self.window, self.run):
            stats.add(accepted, valid, depth, parts)
        return loss, acceptance_counts(logits, target_logp, accepted, valid)
