"""Draft vocabularies (EAGLE-3's reduced vocabulary), shared by every drafter with an LM head.

A draft head that projects onto the target's whole vocabulary pays for it on a CPU: SmolLM2's
49k x 576 projection reads 113 MB and takes ~12 ms, as long as a fifth of a target step, while
the 8k rows of the tokens the target actually writes take ~1 ms. A draft vocabulary is those
rows: `vocab_ids` (V',) sorted target ids, EAGLE-3's d2t map; `draft_index` is the inverse,
t2d, -1 for target tokens outside it. Drafts never propose a token outside their vocabulary,
and the verifier stays exact whatever the draft proposes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn


def check_vocab_ids(vocab_ids: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """`vocab_ids` as a long tensor; ValueError unless distinct, sorted and in range."""
    vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long)
    if (vocab_ids.ndim != 1 or len(vocab_ids) == 0 or vocab_ids.min() < 0
            or vocab_ids.max() >= target_vocab_size
            or not bool((vocab_ids[1:] > vocab_ids[:-1]).all())):
        raise ValueError(f"vocab_ids must be distinct sorted token ids below the target's "
                         f"vocabulary size {target_vocab_size}")
    return vocab_ids


def most_frequent_tokens(sequences: Iterable[torch.Tensor], size: int | None
                         ) -> torch.Tensor | None:
    """The `size` most frequent token ids of `sequences`, sorted; None keeps the whole
    vocabulary. Ties go to the lower id, so the choice is deterministic. Only tokens the
    sequences hold are chosen: where they hold fewer distinct ones than `size`, the
    vocabulary is all of them, and a warning says so (the checkpoint records the size)."""
    if size is None:
        return None
    counts = Counter(int(t) for sequence in sequences for t in sequence.tolist())
    if len(counts) < size:
        logging.getLogger(__name__).warning(
            "draft vocabulary: %d tokens asked for, the training data holds %d distinct ones; "
            "the vocabulary is those %d", size, len(counts), len(counts))
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def coverage(vocab_ids: torch.Tensor | None, sequences: Iterable[torch.Tensor]) -> float:
    """Share of the tokens of `sequences` inside the draft vocabulary (1.0 without one): a
    ceiling on the draft's top-1, since a token outside it is never proposed."""
    tokens = torch.cat([torch.as_tensor(s).reshape(-1) for s in sequences])
    if vocab_ids is None or len(tokens) == 0:
        return 1.0
    return float(torch.isin(tokens, vocab_ids.to(tokens.device)).float().mean())


def draft_index(vocab_ids: torch.Tensor | None, target_vocab_size: int) -> torch.Tensor:
    """(V,) position of each target token in the draft vocabulary (t2d); -1 where it has
    none. Without a draft vocabulary every token is its own index."""
    if vocab_ids is None:
        return torch.arange(target_vocab_size)
    index = torch.full((target_vocab_size,), -1, dtype=torch.long)
    index[vocab_ids.cpu()] = torch.arange(len(vocab_ids))
    return index


def target_ids(vocab_ids: torch.Tensor | None, target_vocab_size: int) -> torch.Tensor:
    """(V',) the target id of each draft-vocabulary index (d2t), on the CPU; without a draft
    vocabulary every index is its own id."""
    return torch.arange(target_vocab_size) if vocab_ids is None else vocab_ids.cpu()


def to_target_vocab(logits: torch.Tensor, vocab_ids: torch.Tensor | None,
                    target_vocab_size: int) -> torch.Tensor:
    """(..., V') draft-vocabulary logits -> (..., V) over the target's vocabulary, -inf for
    tokens the draft cannot propose."""
    if vocab_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], target_vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab_ids.to(logits.device), logits)


def copy_linear(lm_head: nn.Module, rows: torch.Tensor | None = None) -> nn.Linear:
    """A trainable nn.Linear with `lm_head`'s weights (only `rows` of its outputs if given);
    never tied to the target's embeddings."""
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if rows is not None:
        weight, bias = weight[rows], None if bias is None else bias[rows]
    copy = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                     device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        copy.weight.copy_(weight)
        if bias is not None:
            copy.bias.copy_(bias)
    return copy
