"""DFlash: a block drafter over the target's features (z-lab/dflash; Chen et al. 2026).

One draft forward proposes a whole block. Its queries are the block `[root, MASK, ..., MASK]`
(block_size tokens at positions T - 1 .. T - 2 + block_size; the root is the last decided
token); its context is the target's hidden states of every earlier position (several layers,
fused by `fc` F*H -> H and normed by `hidden_norm`), projected into *every* draft layer's keys
and values (no input norm on them). Within the block attention is not causal: every query sees
the whole context and the whole block. Output row i >= 1 (a mask) is the draft's distribution
of the token at position T - 1 + i, through its own head over a reduced draft vocabulary: the
block gives the marginals of depths 1..block_size - 1 at once (drafters.block makes trees of
them). Draft layers are Qwen3-style (per-head RMSNorm on queries and keys), the layout vLLM's
`qwen3_dflash` loads, so a draft trained here exports by renaming nothing.

The context only ever holds the target's real features of accepted tokens, so the drafter's
per-layer context cache grows by the rows the verifier hands over and is never rolled back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    rotate_half,
)

from drafters.block import MASK, BlockDrafter, embed_with_masks
from drafters.checkpoint import (
    check_kind,
    check_target,
    read_config,
    save_module,
    target_record,
)
from drafters.config import typed_config
from drafters.eagle3_layer import eagle3_layer_config
from drafters.trees import TreePolicy
from drafters.vocab import check_vocab_ids, copy_linear, to_target_vocab
from verify.protocol import DraftContext
from verify.runtime.features import eagle3_layers, num_layers, resolve_layers
from verify.runtime.files import load_tensors
from verify.runtime.model import Target

WEIGHTS_FILE = "draft.safetensors"


@dataclass
class DFlashConfig:
    """conf/drafter/dflash.yaml, typed: the only defaults of these keys."""

    name: str = "dflash"
    block_size: int = 8  # query block: the root and block_size - 1 masks (the drafts)
    num_layers: int = 2  # draft decoder layers, each reading the context's keys and values
    feature_layers: list[int] | None = None  # null: eagle3_layers (low, middle, high)
    draft_vocab_size: int | None = 8192  # null: the target's whole vocabulary
    checkpoint: str | None = None  # a trained draft (python train.py drafter=dflash)
    allow_other_target: bool = False
    step: str | None = None  # torch | openvino; null: openvino when target.step=openvino
    # Training only (train.dflash):
    anchors: int = 16  # blocks per sequence, anchored at sampled positions
    loss_decay: float = 4.0  # gamma: draft position k (1-based) weighs exp(-(k - 1) / gamma)


def dflash_config(cfg: Mapping) -> DFlashConfig:
    return check_block_config(typed_config(DFlashConfig, cfg, "DFlash"))


def check_block_config(config: DFlashConfig) -> DFlashConfig:
    """`config` (DFlash's or a subclass's), its block settings checked: ValueError naming the
    key out of range."""
    for key in ("block_size", "num_layers", "anchors"):
        minimum = 2 if key == "block_size" else 1
        if getattr(config, key) < minimum:
            raise ValueError(f"drafter.{key} must be >= {minimum}, got {getattr(config, key)}")
    # position k weighs exp(-(k - 1) / gamma): 0 makes position 1's weight 0/0 (a NaN loss at
    # the first step, after the whole feature extraction), a negative gamma grows with k
    if not config.loss_decay > 0:
        raise ValueError(f"drafter.loss_decay must be > 0 (position k weighs "
                         f"exp(-(k - 1) / loss_decay)), got {config.loss_decay}: the paper's "
                         "is 4 for blocks of 8 (larger weighs later positions more)")
    return config


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (B, heads, n, d) with (B, n, d) tables (rotate-half layout)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Grouped-query attention whose keys and values are the context's and then the block's."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, hidden = config.head_dim, config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, n, H) -> keys (normed, rotated) and values, each (B, kv_heads, n, d)."""
        batch, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, n, self.kv_heads, self.head_dim)
        return rope(k.transpose(1, 2), *rotary), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
                ) -> torch.Tensor:
        """x (B, n, H) block inputs; context keys/values (B, kv_heads, C, d); mask additive
        (B or 1, 1, n, C + n) or None (all visible). Returns (B, n, H)."""
        batch, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, n, self.heads, self.head_dim))
        q = rope(q.transpose(1, 2), *rotary)
        k, v = self.keys_values(x, rotary)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask.to(q.dtype),
            enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, rotary, context, mask):
        h = h + self.self_attn(self.input_layernorm(h), rotary, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer: (B, kv_heads, C, d) x 2


class DFlashDraft(nn.Module):
    """The draft network for a target model.

    feature_layers: absolute hidden-state indices it reads (F of them); vocab_ids (V',) its
    draft vocabulary (None: all V); fc (F*H -> H), hidden_norm, `layers`, norm, lm_head
    (H -> V', starting from the target's rows), mask_embedding (H,) the input of a MASK
    (learned; starts at the mean token embedding). Token embeddings are the target's, frozen,
    not saved here.
    """

    KIND, NAME = "dflash", "DFlash"  # what its checkpoint's config.json names; in messages

    def __init__(self, target: PreTrainedModel, feature_layers: tuple[int, ...],
                 block_size: int, layers: int, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        config, lm_head = target.config, target.get_output_embeddings()
        self.target_vocab_size, hidden = lm_head.weight.shape
        self.feature_layers = resolve_layers(feature_layers, num_layers(config))
        self.block_size = block_size
        if vocab_ids is not None:
            vocab_ids = check_vocab_ids(vocab_ids, self.target_vocab_size)
        self.register_buffer("vocab_ids", vocab_ids)
        self.config = eagle3_layer_config(config)
        self.config.num_hidden_layers = layers
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, self.config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(self.config) for _ in range(layers))
        self.norm = LlamaRMSNorm(hidden, self.config.rms_norm_eps)
        self.lm_head = copy_linear(lm_head, vocab_ids).requires_grad_(True)
        embed = target.get_input_embeddings()
        self.mask_embedding = nn.Parameter(embed.weight.detach().float().mean(0).clone())
        self.rotary = LlamaRotaryEmbedding(self.config)
        self._embed = (embed,)  # the target's, frozen: not saved here
        self.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    @property
    def vocab_size(self) -> int:
        return self.target_vocab_size if self.vocab_ids is None else len(self.vocab_ids)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """features (B, C, F*H) of positions (B, C) -> every layer's context keys/values."""
        x = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        rotary = self.rotary(x, positions)
        return [layer.self_attn.keys_values(x, rotary) for layer in self.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, context: ContextKV,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, n) long, MASK (-1) for a position to predict; positions (B, n); context
        from `context` (C entries); mask additive (B or 1, 1, n, C + n), None: every query
        sees everything. Returns the normed outputs (B, n, H)."""
        h = embed_with_masks(self._embed[0], tokens, self.mask_embedding, self.fc.weight.dtype)
        rotary = self.rotary(h, positions)
        for layer, layer_context in zip(self.layers, context):
            h = layer(h, rotary, layer_context, mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) `forward` outputs -> (..., V') over the draft vocabulary."""
        return self.lm_head(hidden)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V') -> (..., V) over the target's vocabulary, -inf outside the draft's."""
        return to_target_vocab(logits, self.vocab_ids, self.target_vocab_size)

    @property
    def hyperparameters(self) -> dict:
        """What rebuilds this draft on a target, as saved in a checkpoint's config."""
        return {"feature_layers": list(self.feature_layers), "block_size": self.block_size,
                "num_layers": len(self.layers),
                "draft_vocab_size": None if self.vocab_ids is None else self.vocab_size}

    @classmethod
    def rebuilt(cls, target: PreTrainedModel, config: Mapping,
                vocab_ids: torch.Tensor | None) -> DFlashDraft:
        """A fresh draft of a checkpoint's `config` (its `hyperparameters`) on `target`."""
        return cls(target, tuple(config["feature_layers"]), config["block_size"],
                   config["num_layers"], vocab_ids)


def block_inputs(roots: torch.Tensor, starts: torch.Tensor, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks anchored at `starts` (B, A) holding `roots` (B, A): tokens (B, A * b) with the
    root first and MASK after it, positions (B, A * b) start .. start + b - 1."""
    offsets = torch.arange(block_size, device=starts.device)
    positions = (starts[..., None] + offsets).flatten(1)
    tokens = torch.full(positions.shape, MASK, dtype=torch.long, device=starts.device)
    tokens[:, ::block_size] = roots
    return tokens, positions


def block_mask(starts: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The training mask (B, 1, A * b, C + A * b), additive: a query of block j (anchored at
    position starts[:, j]) sees the context positions before its anchor, i.e. the target
    features the verifier would have handed over, and every query of its own block (no causal
    order inside a block); never another block. An invalid block (valid False) sees only its
    own block, so attention stays finite; its rows are left out of the loss."""
    batch, anchors = starts.shape
    device = starts.device
    block_of = torch.arange(anchors * block_size, device=device) // block_size  # (A*b,)
    before = torch.arange(context_len, device=device)[None, None, :] < \
        starts[:, block_of, None]  # (B, A*b, C)
    before = before & valid[:, block_of, None]
    own = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # (B, A*b, A*b)
    allowed = torch.cat([before, own], dim=-1)[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class DFlashDrafter(BlockDrafter):
    """Proposes trees from one DFlash forward per step (drafters.block for the tree).

    Holds one sequence's context keys/values (fork for another row of a batch). The tree is
    a static topology, EAGLE-2's dynamic tree or DDTree, no deeper than block_size - 1.
    """

    def __init__(self, draft: DFlashDraft, tree: TreePolicy, name: str = "dflash"):
        super().__init__(draft, tree, name, draft.block_size - 1, "drafter.block_size - 1")
        self.feature_layers = draft.feature_layers
        self._context: ContextKV | None = None

    def begin(self, prompt: torch.Tensor) -> None:
        self._context = None

    def draft_cache_bytes(self) -> int:
        if self._context is None:
            return 0
        return sum(k.numel() * k.element_size() * 2 for k, _ in self._context)

    def block_marginals(self, ctx: DraftContext) -> torch.Tensor:
        return self.draft.to_target_vocab(self.block_outputs(ctx)[1])

    def block_outputs(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over the block after ctx.tokens[-1]: its normed outputs
        (block_size - 1, H) and draft-vocabulary logits (block_size - 1, V'), float on the
        CPU, row d for depth d + 1 (DSpark's heads read both)."""
        self._extend_context(ctx)
        return self.outputs(int(ctx.tokens[-1]), len(ctx.tokens) - 1)

    def outputs(self, root: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block after `root` (at `position`), over the context held: `block_outputs`."""
        weight = self.draft.fc.weight
        roots = torch.tensor([[root]], device=weight.device)
        tokens, positions = block_inputs(roots, torch.tensor([[position]], device=weight.device),
                                         self.draft.block_size)
        hidden = self.draft(tokens, positions, self._context)[0, 1:]  # (b - 1, H)
        self.forwards += 1
        return hidden.float().cpu(), self.draft.logits(hidden).float().cpu()

    def _extend_context(self, ctx: DraftContext) -> None:
        """Append the features of positions T - 1 - k .. T - 2 to every layer's context."""
        start = self._new_context_start(ctx)
        positions = torch.arange(start, len(ctx.tokens) - 1,
                                 device=self.draft.fc.weight.device)[None]
        new = self.draft.context(ctx.features[None], positions)
        if self._context is None:
            self._context = new
        else:
            self._context = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                             for (k, v), (nk, nv) in zip(self._context, new)]

    def _new_context_start(self, ctx: DraftContext) -> int:
        """The first position ctx.features covers, checked to follow what the context holds."""
        if ctx.features is None:
            raise ValueError(f"{self.name} needs the target's features (ctx.features) at layers "
                             f"{self.feature_layers}; verify.loop.generate computes them")
        count, length = len(ctx.features), len(ctx.tokens)
        start, held = length - 1 - count, self._held()
        if start != held:
            raise ValueError(f"{self.name} got features for positions {start}..{length - 2} "
                             f"but holds {held}: call begin() for a new sequence")
        return start

    def _held(self) -> int:
        return 0 if self._context is None else self._context[0][0].shape[2]


def save_draft(draft: DFlashDraft, folder: str | Path, target: Target, extra=None,
               state: dict | None = None) -> None:
    """Write the draft (draft.safetensors + config.json naming its target) atomically."""
    hidden = draft.lm_head.weight.shape[1]
    config = {"target": target_record(target, hidden, draft.target_vocab_size),
              "drafter": draft.KIND, **draft.hyperparameters}
    save_module(draft, folder, WEIGHTS_FILE, config, extra, state)


def load_draft(folder: str | Path, target: Target, allow_other_target: bool = False,
               kind: type[DFlashDraft] = DFlashDraft) -> DFlashDraft:
    """A draft of `kind` (DFlashDraft or a subclass) saved by `save_draft`, on `target`;
    ValueError for another target's or another kind's."""
    folder = Path(folder)
    check_kind(folder, f"the {kind.NAME} drafter", (kind.KIND,))
    config = read_config(folder)
    if config.get("drafter") != kind.KIND:
        raise ValueError(f"{folder} does not hold a {kind.NAME} draft (its config.json names "
                         f"drafter {config.get('drafter')!r})")
    check_target(config["target"], target, folder, f"{kind.NAME} draft", allow_other_target)
    device = str(target.model.get_output_embeddings().weight.device)
    state = load_tensors(folder / WEIGHTS_FILE, device=device)
    draft = kind.rebuilt(target.model, config, state.get("vocab_ids"))
    draft.load_state_dict(state)  # strict: missing, unexpected or misshapen tensors are named
    return draft


def from_config(cfg: Mapping, tree: TreePolicy, target: Target) -> DFlashDrafter:
    """conf/drafter/dflash.yaml: a fresh (untrained) draft, or `checkpoint: <folder>`."""
    config = dflash_config(cfg)
    return DFlashDrafter(configured_draft(config, target, DFlashDraft), tree, name=config.name)


def configured_draft(config: DFlashConfig, target: Target, kind: type[DFlashDraft],
                     **fresh) -> DFlashDraft:
    """The draft of `kind` a drafter config names: its checkpoint, else a fresh one made with
    the config's layers and sizes (and `fresh`, the subclass's own arguments). A checkpoint
    runs at the block size it was trained for: another is refused, by name."""
    if not config.checkpoint:
        layers = config.feature_layers or eagle3_layers(num_layers(target.model.config))
        return kind(target.model, tuple(layers), config.block_size, config.num_layers,
                    **fresh)
    draft = load_draft(config.checkpoint, target, config.allow_other_target, kind)
    if draft.block_size != config.block_size:
        raise ValueError(f"drafter.block_size={config.block_size}, but {config.checkpoint} "
                         f"was trained with block_size {draft.block_size}: its masks attend "
                         "to each other, so another block size is another model; set "
                         f"drafter.block_size={draft.block_size}")
    return draft
