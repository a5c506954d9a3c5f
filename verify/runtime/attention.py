"""`attn_implementation="sdpa_gqa"`: SDPA that never copies grouped key/value heads.

Grouped-query models keep fewer key/value heads than query heads (SmolLM2-135M: 3 for 9).
transformers' "sdpa" lets torch broadcast them (`enable_gqa`) only when no mask is given, i.e.
in plain one-token decoding; every tree verification carries a tree mask, so there it first
repeats each layer's whole cached keys and values to the query heads' count, a copy of ~3x the
cache per layer per forward. This implementation passes `enable_gqa` with the mask too. Outputs
are the same numbers (tests compare both on trees, prefill and decoding); only the copy goes.

It is registered with transformers' own extension points (AttentionInterface, and the "sdpa"
mask builder for AttentionMaskInterface), so any causal LM loads with it by name. Models that
add a position bias or soft-capping to attention are refused: use "sdpa" for them.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa"


def sdpa_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, Hq, q, D), key and value (B, Hkv, k, D) with Hq a multiple of Hkv, mask None
    or (B or 1, 1, q, k) -> attention output (B, q, Hq, D), as transformers' attention
    functions return it."""
    for unsupported in ("position_bias", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"{NAME} does not apply {unsupported}; load this model "
                                      "with attn_implementation='sdpa'")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # Without a mask the caller relies on causality, which SDPA aligns top-left: right only
    # when queries and keys start together (transformers' sdpa mask builder drops the mask in
    # exactly those cases: one query, or no cached keys).
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=bool(causal) and attention_mask is None and query.shape[2] > 1,
        enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_gqa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
