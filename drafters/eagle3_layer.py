"""EAGLE-3's draft layer, in the layout of the paper's code and of the serving engines.

EAGLE-1's draft projects [token embedding, feature] (2H) to H and runs an ordinary decoder
layer on the sum. EAGLE-3's keeps the two apart until attention:

    x = [input_layernorm(embed(token)), hidden_norm(g)]        (2H: embedding first)
    h = g + o_proj(attention(q_proj x, k_proj x, v_proj x))    (q/k/v read 2H)
    h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))

where g is fc(fused target features) at the first draft step and the draft's own pre-norm
output h afterwards. This is the layout `speculators` checkpoints (what vLLM serves) and SGLang
load, so a draft trained here exports without conversion error (drafters.export). Attention is
Llama's: rotary positions, grouped-query heads, sdpa with an additive mask.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


def eagle3_layer_config(target: PretrainedConfig) -> LlamaConfig:
    """A one-layer Llama config with the target's widths, heads and positions (any target
    architecture: the draft layer is Llama-style, as speculators' is)."""
    hidden = target.hidden_size
    heads = target.num_attention_heads
    rope = getattr(target, "rope_parameters", None) or {"rope_type": "default",
                                                         "rope_theta": 10000.0}
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=getattr(target, "intermediate_size", None) or 4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
        head_dim=getattr(target, "head_dim", None) or hidden // heads,
        rms_norm_eps=getattr(target, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters=dict(rope),
        vocab_size=target.vocab_size,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose projections read the 2H concatenation."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor, cache: DynamicCache | None) -> torch.Tensor:
        """x (B, n, 2H); mask additive (B or 1, 1, n, cached + n); returns (B, n, H)."""
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rotary)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1))


class Eagle3Layer(nn.Module):
    """The draft layer and its final norm; `config` from `eagle3_layer_config`.

    norm_before_residual: the residual is hidden_norm(g) instead of g (a speculators option,
    off in EAGLE-3's code); recorded in exports.
    """

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False):
        super().__init__()
        self.config = config
        self.norm_before_residual = norm_before_residual
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(hidden, eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(hidden, eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                cache: DynamicCache | None = None) -> torch.Tensor:
        """embedded, hidden (B, n, H); positions (B, n). attention_mask: None (causal), (B,
        cached + n) padding (1 = real), or an additive (B, 1, n, cached + n) mask. Returns
        the pre-norm output h (B, n, H); with `cache`, keys/values are appended."""
        cached = cache.get_seq_length() if cache is not None else 0
        mask = additive_mask(attention_mask, embedded.shape[1], cached, hidden.dtype,
                             hidden.device)
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embedded), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        h = residual + self.self_attn(x, self.rotary(hidden, positions), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def additive_mask(attention_mask: torch.Tensor | None, n: int, cached: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (B or 1, 1, n, cached + n) additive mask for the three forms forward accepts.
    Blocked entries get the dtype's minimum, not -inf, so a row with nothing visible (a
    padding query) stays finite."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    keys = torch.arange(cached + n, device=device)
    allowed = keys[None, :] <= cached + torch.arange(n, device=device)[:, None]  # (n, c + n)
    allowed = allowed[None, None]
    if attention_mask is not None:  # (B, cached + n) padding
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)
