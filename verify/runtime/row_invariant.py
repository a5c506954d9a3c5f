"""`attn_implementation="row_invariant"`: attention whose result for one query row does not
depend on where its visible keys sit in the cache, nor on the other rows.

Why: in bfloat16 a tree node and the same token decoded alone can round apart, and greedy
output then flips at near-ties. With `pad_rows` (verify.loop) every step runs the same matrix
shapes, which makes each projection's row independent of the tree (measured: q/k/v and MLP
rows then agree bit for bit), but SDPA still reduces over the whole cache in slot order, and a
tree node's ancestors sit in other slots than the same tokens once committed. Here each query
row attends on its own: its visible keys are gathered in cache order into one contiguous
sequence (the prompt, the committed tokens, its ancestors, itself: the same sequence, in the
same order, whether the ancestors are committed or still in the tree), padded at the end to a
multiple of WIDTH_STEP with keys it may not see; then scores, a float32 softmax and the
weighted sum, all rows at once as batched matrix products whose reductions meet each real key
at the same index either way (the padding adds exact zeros).

Gathering copies every row's visible keys, so it serves verification steps (a few rows); a
forward of more than PREFILL_ROWS rows (a prompt) goes through SDPA, the same for every
decoding path.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verify.runtime.attention import sdpa_gqa_attention

NAME = "row_invariant"
PREFILL_ROWS = 64
WIDTH_STEP = 64  # gathered key sequences are padded to a multiple of this


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
    scale = dim ** -0.5 if scaling is None else scaling
    slots, valid = _slots_for(attention_mask, batch, rows, key.shape[2], key.device)
    kv_heads, groups = key.shape[1], heads // key.shape[1]
    # Scores over the whole cache: each is one dot product over D, whatever its slot.
    grouped = query.reshape(batch, kv_heads, groups * rows, dim)
    scores = (grouped @ key.transpose(-1, -2)).float() * scale  # (B, Hkv, G * q, S)
    scores = scores.view(batch, kv_heads, groups, rows, -1).transpose(2, 3)  # (B, Hkv, q, G, S)
    index = slots[:, None, :, None, :].expand(-1, kv_heads, -1, groups, -1)
    scores = scores.gather(-1, index).masked_fill(~valid[:, None, :, None], float("-inf"))
    probs = scores.softmax(-1).to(value.dtype)  # (B, Hkv, q, G, W), visible keys in order
    # The weighted sum reduces over the gathered values: the one order-sensitive reduction.
    values = value[:, :, None].expand(-1, -1, rows, -1, -1).gather(
        3, slots[:, None, :, :, None].expand(-1, kv_heads, -1, -1, dim))  # (B, Hkv, q, W, D)
    output = (probs @ values).permute(0, 1, 3, 2, 4)  # (B, Hkv, G, q, D)
    output = output.reshape(batch, heads, rows, dim)
    return output.transpose(1, 2).contiguous(), None


_last: list = [None, None]  # (the mask and sizes of the last forward, its slots): every layer
#                             of one forward shares the mask, so the slots are found once


def _slots_for(mask: torch.Tensor | None, batch: int, rows: int, total: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (mask, batch, rows, total)
    if _last[0] is None or _last[0][0] is not mask or _last[0][1:] != key[1:]:
        _last[:] = [key, _gathered_slots(mask, batch, rows, total, device)]
    return _last[1]


def _gathered_slots(mask: torch.Tensor | None, batch: int, rows: int, total: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, q, W) the cache slots each query row sees, in cache order, then padding (slot 0),
    and (B, q, W) which are real. W is rounded up to a multiple of WIDTH_STEP, so that a
    row's reduction sees its keys at the same indices whatever else the forward holds."""
    if mask is None:  # causal: every cached key and the rows up to i
        allowed = (torch.arange(total, device=device)[None, :]
                   <= total - rows + torch.arange(rows, device=device)[:, None])
        allowed = allowed[None].expand(batch, -1, -1)
    else:
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        allowed = allowed.expand(batch, -1, -1)
    counts = allowed.sum(-1)  # (B, q)
    width = -(-int(counts.max()) // WIDTH_STEP) * WIDTH_STEP
    # stable sort puts allowed slots first, in cache order
    order = torch.sort((~allowed).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    if order.shape[-1] < width:
        order = torch.cat([order, order.new_zeros(*order.shape[:-1], width - order.shape[-1])], -1)
    valid = torch.arange(width, device=device)[None, None] < counts[..., None]
    return order.masked_fill(~valid, 0), valid


AttentionInterface.register(NAME, row_invariant_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
