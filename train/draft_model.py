"""Distilling a separate draft model from the target (DistillSpec, Zhou et al. 2024).

The student is a small causal LM with the target's tokenizer: a trainable copy of the target's
first layers (`init: truncate`) or a fresh, narrower model of the same architecture (`init:
fresh`). Its LM head covers a reduced draft vocabulary (drafters.vocab): the rows of the tokens
the target writes most, so a draft forward pays ~1 ms of projection instead of ~12.

Row t of a sequence (the student has read tokens 0..t) learns the target's next-token
distribution p_t = softmax(target LM head(f^L_t)), computed from the target's cached last
states (train.features) over the draft vocabulary and renormalised there: the mass the target
puts outside it is mass the draft can never propose anyway. Only rows whose next token is one
to learn (an assistant token) count.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from drafters.config import shallow_config
from drafters.draft_model import DraftModelConfig, truncated_copy
from drafters.vocab import copy_linear
from train.distributed import global_mean
from train.loop import hit_counts

DIVERGENCES = ("forward_kl", "reverse_kl", "tv")
INITS = ("truncate", "fresh")


def divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor, kind: str
               ) -> torch.Tensor:
    """(..., V') logits of the target (p) and the draft (q) -> (...) per-row divergence.

    forward_kl: KL(p || q), the usual distillation loss (mass-covering); reverse_kl: KL(q || p)
    (mode-seeking); tv: total variation 0.5 * sum |p - q|, exactly 1 - the probability that
    speculative sampling accepts one token drawn from q (DistillSpec's motivation)."""
    log_p, log_q = target_logits.float().log_softmax(-1), draft_logits.float().log_softmax(-1)
    if kind == "forward_kl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "reverse_kl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if kind == "tv":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    raise ValueError(f"drafter.divergence must be one of {DIVERGENCES}, got {kind!r}")


def initial_draft(target: PreTrainedModel, config: DraftModelConfig,
                  vocab_ids: torch.Tensor | None) -> PreTrainedModel:
    """The student before training, on the target's device and dtype.

    truncate: a copy (its own tensors) of the target's first num_layers layers and final norm.
    fresh: new weights from the target's config with num_layers layers and `architecture`'s
    keys overriding it (hidden_size, intermediate_size, num_attention_heads, ...).
    Either way the head is untied from the embeddings and cut to vocab_ids (V',), starting
    from the target's rows when the widths agree. Token embeddings copied from the target stay
    frozen (they only look tokens up); fresh ones of another width train.
    """
    if config.init == "truncate":
        if config.architecture:
            raise ValueError("drafter.architecture applies to init=fresh only; init=truncate "
                             "copies the target's layers as they are")
        draft = copy.deepcopy(truncated_copy(target, config.num_layers))
    elif config.init == "fresh":
        draft = AutoModelForCausalLM.from_config(fresh_config(target.config, config))
    else:
        raise ValueError(f"drafter.init must be one of {INITS}, got {config.init!r}")
    target_head = target.get_output_embeddings()
    same_width = draft.config.hidden_size == target.config.hidden_size
    if same_width:
        head = copy_linear(target_head, vocab_ids)
        if config.init == "fresh":
            draft.get_input_embeddings().weight.data = target.get_input_embeddings().weight.clone()
    else:
        rows = target_head.weight.shape[0] if vocab_ids is None else len(vocab_ids)
        head = nn.Linear(draft.config.hidden_size, rows, bias=False)
    draft.config.tie_word_embeddings = False
    draft.set_output_embeddings(head)
    draft.get_input_embeddings().requires_grad_(not same_width)
    draft.to(device=target_head.weight.device, dtype=target_head.weight.dtype)
    return draft.train()


def fresh_config(target_config, config: DraftModelConfig):
    """The target's config with num_layers layers and `architecture`'s overrides; head_dim
    follows a new width unless given (Llama configs state it explicitly)."""
    fresh = shallow_config(target_config, config.num_layers)
    architecture = config.architecture or {}
    unknown = [key for key in architecture if not hasattr(fresh, key)]
    if unknown:
        raise ValueError(f"drafter.architecture keys {unknown} are not in the target's "
                         f"{type(fresh).__name__}")
    for key, value in architecture.items():
        setattr(fresh, key, value)
    if getattr(fresh, "head_dim", None) is not None and "head_dim" not in architecture:
        fresh.head_dim = fresh.hidden_size // fresh.num_attention_heads
    return fresh


class DistillLoss(nn.Module):
    """The student's divergence from the target on a batch of right-padded sequences.

    target_head: the target's LM head; its rows of the draft vocabulary are kept, frozen, to
    turn cached last states into the target's logits."""

    def __init__(self, draft: PreTrainedModel, target_head: nn.Module,
                 vocab_ids: torch.Tensor | None, kind: str):
        super().__init__()
        if kind not in DIVERGENCES:
            raise ValueError(f"drafter.divergence must be one of {DIVERGENCES}, got {kind!r}")
        self.draft, self.kind = draft, kind
        self.target_head = copy_linear(target_head, vocab_ids).requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, learn: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T); features (B, T, H) the target's last states; learn (B, T) the
        tokens to learn (False on padding). Right padding needs no attention mask: under causal
        attention no real token sees it. Returns the mean divergence over counted rows and
        counts (1, 3): [rows, top-1 hits, top-5 hits] against the target's argmax."""
        draft_logits = self.draft(input_ids=input_ids).logits[:, :-1]  # row t predicts t + 1
        with torch.no_grad():
            target_logits = self.target_head(features[:, :-1].to(self.target_head.weight))
        rows = learn[:, 1:]
        per_row = divergence(target_logits, draft_logits, self.kind)
        loss = global_mean((per_row * rows).sum(), rows.sum())  # torchrun: over the global batch
        counts = hit_counts(draft_logits.detach().float(), target_logits.argmax(-1), rows)
        return loss, counts[None]
