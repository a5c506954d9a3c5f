"""vLLM 0.32's DFlash draft step, re-done from an exported folder alone (config.json,
model.safetensors, mask_embedding.pt), independently of drafters.dflash: the convention test's
other side (tests/drafters/test_export_dflash.py).

What it follows (vLLM 0.32, read for facts): the target hands the drafter the hidden states
it captured at `eagle_aux_hidden_state_layer_ids` (speculators' `aux_hidden_state_layer_ids`),
id k being the *input* of decoder layer k, i.e. HF hidden state k
(`get_eagle3_aux_layers_from_config`, the target's aux capture); `combine_hidden_states` is
`fc` on their concatenation; `precompute_and_store_context_kv` norms that by `hidden_norm`,
projects every layer's k/v from it (no input norm), RMS-norms k per head (`k_norm`) and
rotates it (neox layout) at the context positions; the query block is the bonus token and
num_speculative_tokens copies of `mask_token_id` at the next positions, embedded by
`embed_tokens` with the mask id's row swapped for `mask_embedding.pt`; layers are pre-norm
Qwen3 (per-head q/k norm, rope) attending, non-causally, to the cached context and the whole
block; `norm`, `lm_head`, then logits scattered to target ids draft id + d2t (-inf elsewhere).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def neox_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (n, heads, d) rotated at positions (n,): halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq  # (n, d/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def block_logits(folder: Path, hidden_states: list[torch.Tensor], root: int,
                 block_shift: int = 0) -> torch.Tensor:
    """The logits of the draft tokens after `root`: hidden_states are the target's HF hidden
    states (each (T, H)) of positions 0..T-1, the root sits at T. Returns (K, V) float32,
    K = the folder's speculative_tokens. `block_shift` moves the block's rope positions
    against the context's (a wrong convention, e.g. the root at the last feature's position,
    for the test to catch: moving both would change nothing, rope being relative)."""
    config = json.loads((folder / "config.json").read_text())
    layer = config["transformer_layer_config"]
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    mask = torch.load(folder / "mask_embedding.pt", weights_only=True)
    eps, theta = layer["rms_norm_eps"], layer["rope_theta"]
    heads, kv_heads, d = (layer["num_attention_heads"], layer["num_key_value_heads"],
                          layer["head_dim"])
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    context_len = hidden_states[0].shape[0]

    aux = torch.cat([hidden_states[i] for i in config["aux_hidden_state_layer_ids"]], -1)
    context = rms(aux.float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(context_len)
    ids = torch.tensor([root] + [config["mask_token_id"]] * k)
    x = w["embed_tokens.weight"][ids]
    x = torch.where((ids == mask["mask_token_id"])[:, None], mask["embedding"].float(), x)
    q_pos = torch.arange(context_len, context_len + k + 1) + block_shift

    for i in range(layer["num_hidden_layers"]):
        p = f"layers.{i}."

        def keys_values(h, positions):
            key = rms((h @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, d),
                      w[p + "self_attn.k_norm.weight"], eps)
            value = (h @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
            return neox_rope(key, positions, theta), value

        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, d),
                w[p + "self_attn.q_norm.weight"], eps)
        q = neox_rope(q, q_pos, theta)
        ck, cv = keys_values(context, ctx_pos)
        bk, bv = keys_values(h, q_pos)
        keys = torch.cat([ck, bk]).repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([cv, bv]).repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * d ** -0.5  # no causal mask
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(len(ids), -1)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    draft = rms(x, w["norm.weight"], eps)[1:] @ w["lm_head.weight"].T  # (K, V')
    target_ids = torch.arange(draft.shape[1]) + w.get("d2t", torch.zeros(draft.shape[1])).long()
    logits = torch.full((k, layer["vocab_size"]), float("-inf"))
    logits[:, target_ids] = draft
    return logits
