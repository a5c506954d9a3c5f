"""`attn_implementation="row_invariant"`: attention whose result for one query row does not
depend on where its visible keys sit in the cache, nor on the other rows.

Why: in bfloat16 a tree node and the same token decoded alone can round apart, and greedy
output then flips at near-ties. With `pad_rows` (verify.loop) every step runs the same matrix
shapes, which makes each projection's row independent of the tree (measured: q/k/v and MLP
rows then agree bit for bit), but SDPA still reduces over the whole cache in slot order, and a
tree node's ancestors sit in other slots than the same tokens once committed. Here each query
row attends on its own: its visible keys are gathered in cache order into one contiguous
sequence (the prompt, the committed tokens, its ancestors, itself: the same sequence, in the
same order, whether the ancestors are committed or still in the tree), then one matmul, a
float32 softmax and one matmul, with shapes that depend on that sequence only.

It costs a Python loop over query rows: for verification steps (a few rows) only; a forward of
more than PREFILL_ROWS rows (a prompt) goes through SDPA, the same for every decoding path.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verify.attention import sdpa_gqa_attention

NAME = "row_invariant"
PREFILL_ROWS = 64


def row_invariant_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, Hq, q, D), key and value (B, Hkv, k, D), mask None (causal) or additive
    (B or 1, 1, q, k) -> attention output (B, q, Hq, D), as transformers' attention functions
    return it."""
    batch, heads, rows, dim = query.shape
    if rows > PREFILL_ROWS:
        return sdpa_gqa_attention(module, query, key, value, attention_mask, dropout,
                                  scaling, is_causal, **kwargs)
    groups = heads // key.shape[1]
    scale = dim ** -0.5 if scaling is None else scaling
    total = key.shape[2]
    output = query.new_empty(batch, rows, heads, dim)
    for b in range(batch):
        for i in range(rows):
            visible = _visible(attention_mask, b, i, rows, total, key.device)
            keys = key[b].index_select(1, visible).repeat_interleave(groups, 0)  # (Hq, n, D)
            values = value[b].index_select(1, visible).repeat_interleave(groups, 0)
            scores = (query[b, :, i:i + 1] @ keys.transpose(1, 2)).float() * scale
            output[b, i] = (scores.softmax(-1).to(values.dtype) @ values)[:, 0]
    return output, None


def _visible(mask: torch.Tensor | None, b: int, i: int, rows: int, total: int,
             device: torch.device) -> torch.Tensor:
    """Cache slots query row i of sequence b may see, in cache order."""
    if mask is None:  # causal: every cached key and the rows up to i
        return torch.arange(total - rows + i + 1, device=device)
    row = mask[b if mask.shape[0] > 1 else 0, 0, i]
    allowed = row if row.dtype == torch.bool else row == 0  # a boolean or an additive mask
    return allowed.nonzero().flatten()


AttentionInterface.register(NAME, row_invariant_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
