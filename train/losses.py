"""The per-row objective a draft trains on against the target's distribution (optim.loss).

Each row has the target's distribution p and the draft's q over the draft vocabulary. The
probability that speculative sampling accepts one token drawn from q is alpha = sum min(p, q)
(= 1 - TV(p, q)); it is what a draft is for, so every objective reports it.

- ce: the soft cross-entropy -sum p log q (EAGLE's, DFlash's; KL(p || q) up to p's entropy);
- lk: -log alpha, training on the expected acceptance itself (Samarin et al. 2026, "LK losses");
- lk_hybrid: lambda KL(p || q) + (1 - lambda) TV(p, q) with lambda = exp(-eta alpha), alpha
  held constant: KL's dense gradient while the draft is far from p, TV (the acceptance) once
  it is close.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.loop import hit_counts
from train.schema import LOSSES

# -log alpha stays finite (~69) when q puts no float32 mass where p has any
MIN_ALPHA = 1e-30


@dataclass(frozen=True)
class RowLoss:
    """optim.loss and optim.lk_eta: `kind` one of LOSSES, `eta` lk_hybrid's sharpness."""

    kind: str = "ce"
    eta: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"optim.loss must be one of {LOSSES}, got {self.kind!r}")

    @staticmethod
    def from_optim(optim) -> RowLoss:
        """The objective a conf/optim mapping (train.schema.OptimConfig) names."""
        return RowLoss(optim.loss, float(optim.lk_eta))

    def __call__(self, target_probs: torch.Tensor, draft_logits: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """target_probs p (..., V') and float draft_logits (..., V') -> the per-row loss (...)
        and the acceptance alpha (...), detached."""
        log_q = draft_logits.log_softmax(-1)
        if self.kind == "ce":
            with torch.no_grad():
                alpha = acceptance(target_probs, log_q.exp())
            return -(target_probs * log_q).sum(-1), alpha
        alpha = acceptance(target_probs, log_q.exp())
        if self.kind == "lk":
            return -alpha.clamp_min(MIN_ALPHA).log(), alpha.detach()
        kl = (torch.special.xlogy(target_probs, target_probs) - target_probs * log_q).sum(-1)
        mix = torch.exp(-self.eta * alpha.detach())
        return mix * kl + (1 - mix) * (1 - alpha), alpha.detach()


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V') distributions -> (...) sum min(p, q): the chance that speculative sampling
    accepts one token drawn from q when the target samples from p."""
    return torch.minimum(p, q).sum(-1)


def row_counts(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
               alpha: torch.Tensor) -> torch.Tensor:
    """(4,) [rows, top-1 hits, top-5 hits, summed alpha] over the rows marked in `rows` (...):
    train.loop.hit_counts of (..., V') logits against (...) targets, then the acceptance."""
    return torch.cat([hit_counts(logits, targets, rows), (alpha * rows).sum()[None].float()])
