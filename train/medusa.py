"""Medusa's training objectives (Cai et al. 2024).

Medusa-1: the target stays frozen and only the heads learn; its hidden states can be cached.
Loss = sum_k decay^k * CE(head k, token k + 2 ahead): later heads are less certain and count less.
Medusa-2: the target learns too, through a LoRA adapter, so the hidden states must be computed
in every step; loss = LM loss (+ KL to the original target) + head_loss_weight * heads' loss.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.medusa import MedusaHeads
from drafters.vocab import most_frequent_tokens
from train.distill import Answer
from train.features import FeatureSet, SequenceFeatures
from train.loop import hit_counts


def choose_draft_vocab(answers: list[Answer], size: int | None) -> torch.Tensor | None:
    """The `size` tokens most frequent in the answers and their prompts (drafters.vocab).
    Prompt tokens count because answers copy them (names in a summary): on held-out answers
    they raised an 8k vocabulary's coverage from 79% to 87%."""
    return most_frequent_tokens((part for a in answers for part in (a.prompt, a.response)), size)


def head_targets(response: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(R,) answer -> (R, K) targets: row s (the state that predicted token s) asks head k for
    token s + k + 1; -1 past the end of the answer."""
    length = len(response)
    padded = torch.cat([response, response.new_full((num_heads + 1,), -1)])
    rows = torch.arange(length)[:, None] + torch.arange(1, num_heads + 1)[None]  # (R, K)
    return padded[rows]


def cached_rows(answers: list[Answer], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All answers' cached hidden states (N, H) and their head targets (N, K)."""
    if any(a.hidden is None for a in answers):
        raise ValueError("these answers carry no hidden states to train on")
    hidden = torch.cat([a.hidden for a in answers])
    targets = torch.cat([head_targets(a.response, num_heads) for a in answers])
    return hidden, targets


def feature_rows(features: FeatureSet, num_heads: int, lm_head: nn.Module | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefilled sequences (ShareGPT conversations, answers) as Medusa-1 rows: the (N, H)
    states whose next token is learned (an assistant token) and their (N, K) head targets.
    Row t's state predicted token t + 1, so head k asks for token t + k + 2; -1 where that
    token is past the end or not learned (a user turn).

    With the target's `lm_head`, the token asked for is the target's own greedy choice at
    position t + k + 2 given the text before it (the argmax of its logits at row t + k + 1),
    not the text's: at decoding time the heads predict the target, and text written by another
    model (ShareGPT: ChatGPT) differs from what the target would write.
    """
    if len(features.layers) != 1:
        raise ValueError(f"Medusa heads read one state per token; these features hold layers "
                         f"{features.layers}")
    hidden, targets = [], []
    offsets = torch.arange(2, num_heads + 2)
    for s in features:
        tokens = s.input_ids if lm_head is None else _target_tokens(s, lm_head)
        learned = torch.where(s.loss_mask, tokens, -1)
        padded = torch.cat([learned, learned.new_full((num_heads + 2,), -1)])
        rows = s.loss_mask[1:].nonzero().squeeze(1)  # states that predicted a learned token
        hidden.append(s.features[rows])
        targets.append(padded[rows[:, None] + offsets[None]])
    return torch.cat(hidden), torch.cat(targets)


@torch.no_grad()
def _target_tokens(sequence: SequenceFeatures, lm_head: nn.Module) -> torch.Tensor:
    """(T,) the target's greedy token at each position given the tokens before it (position
    0, which nothing predicts, keeps its own)."""
    weight = lm_head.weight
    predicted = torch.cat([lm_head(rows.to(weight)).argmax(-1).cpu()
                           for rows in sequence.features.split(1024)])  # token j + 1 at row j
    return torch.cat([sequence.input_ids[:1], predicted[:-1]])


class HeadLoss(nn.Module):
    """Weighted cross-entropy of every head, computed head by head."""

    def __init__(self, heads: MedusaHeads, decay: float):
        super().__init__()
        self.heads, self.decay = heads, decay
        self.register_buffer("draft_index", heads.draft_index(), persistent=False)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (N, H), targets (N, K) token ids (-1: none) -> loss, and counts (K, 3):
        per head [rows with a target, top-1 hits, top-5 hits] for accuracy metrics.

        A target outside the draft vocabulary cannot be learned: no loss, but a miss.
        """
        loss = hidden.new_zeros((), dtype=torch.float32)
        counts = []
        for k in range(targets.shape[1]):
            has_target = targets[:, k] >= 0
            draft = torch.where(has_target, self.draft_index[targets[:, k].clamp_min(0)], -1)
            logits = self.heads.head_logits(hidden, k).float()  # (N, V')
            # A sum over the learnable rows, not a mean: a batch without any still gives every
            # head a (zero) gradient, which DDP needs from every rank.
            ce = nn.functional.cross_entropy(logits, draft, ignore_index=-1, reduction="sum")
            loss = loss + self.decay ** k * ce / (draft >= 0).sum().clamp_min(1)
            counts.append(hit_counts(logits.detach(), draft, has_target))
        return loss, torch.stack(counts)


class Medusa2Loss(nn.Module):
    """LM loss of the adapted target (+ KL to the original) and the heads' loss, on sequences.

    peft_model: the target wrapped by peft (LoRA); disabling the adapter gives the original
    target for the KL term.
    """

    def __init__(self, peft_model: nn.Module, heads: MedusaHeads, decay: float,
                 head_loss_weight: float, kl_weight: float):
        super().__init__()
        self.model, self.head_loss = peft_model, HeadLoss(heads, decay)
        self.head_loss_weight, self.kl_weight = head_loss_weight, kl_weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                rows: torch.Tensor, lm_targets: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask (B, T); rows (N, 2) the (sequence, position) of each
        answer state; lm_targets (N,) the token each predicts; targets (N, K) the heads'."""
        hidden = self._states(input_ids, attention_mask)[rows[:, 0], rows[:, 1]]  # (N, H)
        logits = self.model.get_output_embeddings()(hidden).float()  # (N, V)
        loss = nn.functional.cross_entropy(logits, lm_targets)
        if self.kl_weight:
            loss = loss + self.kl_weight * self._kl_to_original(logits, input_ids,
                                                                 attention_mask, rows)
        head_loss, counts = self.head_loss(hidden, targets)
        return loss + self.head_loss_weight * head_loss, counts

    def _states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last-layer hidden states (B, T, H), the same ones decoding hands the heads."""
        body = self.model.get_base_model().base_model
        return body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def _kl_to_original(self, logits: torch.Tensor, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.model.disable_adapter():
            original = self._states(input_ids, attention_mask)[rows[:, 0], rows[:, 1]]
            reference = self.model.get_output_embeddings()(original).float().log_softmax(-1)
        return nn.functional.kl_div(logits.log_softmax(-1), reference, log_target=True,
                                    reduction="batchmean")


def answer_batch_inputs(answers: list[Answer]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced inputs for a batch of answers: right-padded prompt + answer sequences
    input_ids and attention_mask (B, T), and rows (N, 2), the (sequence, position) of each
    answer state, in answer order (row s of an answer predicted its token s).

    Padding sits after every real token and is masked, so its id (0) never reaches a state
    that is read.
    """
    sequences = [torch.cat([a.prompt, a.response[:-1]]) for a in answers]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros((len(answers), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    rows = []
    for b, (answer, sequence) in enumerate(zip(answers, sequences)):
        input_ids[b, :len(sequence)] = sequence
        attention_mask[b, :len(sequence)] = 1
        start = len(answer.prompt) - 1  # the state that predicted answer token 0
        positions = torch.arange(start, start + len(answer.response))
        rows.append(torch.stack([torch.full_like(positions, b), positions], dim=1))
    return input_ids, attention_mask, torch.cat(rows)


def sequence_batch(answers: list[Answer], num_heads: int) -> dict:
    """The keyword arguments of Medusa2Loss.forward for a batch of answers."""
    input_ids, attention_mask, rows = answer_batch_inputs(answers)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "rows": rows,
            "lm_targets": torch.cat([a.response for a in answers]),
            "targets": torch.cat([head_targets(a.response, num_heads) for a in answers])}
