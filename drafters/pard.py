"""PARD: a small causal LM adapted to draft a whole block in one forward (AMD-AGI/PARD; An et al.
2025, arXiv 2504.18583).

The draft is an ordinary causal LM with the target's tokenizer (drafters.draft_model: the
target cut to its first layers, or a distilled draft folder) that also reads a MASK input. One
forward over `[context ..., root, MASK x (k - 1)]` (k = block_size) gives k distributions: the
output at the root predicts depth 1, the output at mask i predicts depth i + 1. Attention stays
causal, so mask i sees the context and masks 1..i - 1; training (train.pard) shows each mask
exactly that. It reads no target features: one PARD draft serves every target of its family.

The MASK input is a learned embedding (H,), not a token id: the draft's token table is the
target's, frozen and shared (draft_model.share_token_table), and tiny or fully used
vocabularies have no spare id to give it. It is saved beside the Hugging Face folder in
pard_mask.json (JSON, not safetensors: engines load every *.safetensors of a folder as model
weights), with the block size it was trained for; the untrained self-draft starts it at the
mean token embedding.

Per step the draft's KV cache gets the tokens it has not seen (the accepted path and the bonus
token) and the masks; the masks' entries are cropped right after, so the cache only ever holds
committed tokens and the next step needs no rollback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from drafters.block import MASK, BlockDrafter, embed_with_masks
from drafters.checkpoint import PARD_MASK_FILE, check_kind
from drafters.config import typed_config
from drafters.draft_model import DraftModelConfig, load_draft_model, truncated_copy
from drafters.trees import TreePolicy
from drafters.vocab import check_vocab_ids, to_target_vocab
from verify.protocol import DraftContext
from verify.runtime.cache import allocated_bytes
from verify.runtime.files import read_json
from verify.runtime.model import Target


@dataclass
class PardConfig(DraftModelConfig):
    """conf/drafter/pard.yaml, typed: draft_model's keys (path, num_layers, init, ...) and the
    block's."""

    name: str = "pard"
    block_size: int = 8  # k: tokens one forward predicts (the root's next and k - 1 masks')
    # Training only: conditional drop. Offset g keeps a share max(keep_ratio**g, keep_min) of
    # the anchors kept at offset g - 1 (1.0: every anchor trains every offset).
    keep_ratio: float = 0.7
    keep_min: float = 0.2


def pard_config(cfg: Mapping) -> PardConfig:
    config: PardConfig = typed_config(PardConfig, cfg, "PARD")
    if config.block_size < 2:
        raise ValueError(f"drafter.block_size must be >= 2, got {config.block_size}")
    if config.iid_siblings:
        raise ValueError("drafter.iid_siblings: PARD draws a block's children without "
                         "replacement from its marginals (drafters.block); it has no i.i.d. mode")
    if not (0 < config.keep_ratio <= 1 and 0 <= config.keep_min <= 1):
        raise ValueError("drafter.keep_ratio must be in (0, 1] and keep_min in [0, 1], got "
                         f"{config.keep_ratio}, {config.keep_min}")
    return config


class PardDraft(nn.Module):
    """A causal LM `model` (its head over V' = len(vocab_ids) rows, or V) with a learned
    mask_embedding (H,) for MASK inputs, predicting `block_size` tokens per forward."""

    def __init__(self, model: PreTrainedModel, block_size: int,
                 vocab_ids: torch.Tensor | None, mask_embedding: torch.Tensor):
        super().__init__()
        self.model, self.block_size = model, block_size
        self.target_vocab_size = model.config.vocab_size
        self.vocab_ids = (None if vocab_ids is None
                          else check_vocab_ids(vocab_ids, self.target_vocab_size))
        table = model.get_input_embeddings().weight
        self.mask_embedding = nn.Parameter(mask_embedding.detach().to(table).clone())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n) long ids, MASK where to predict -> (B, n, H) inputs."""
        return embed_with_masks(self.model.get_input_embeddings(), tokens, self.mask_embedding)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: DynamicCache | None = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """tokens, positions (B, n); attention_mask additive (B or 1, 1, n, cached + n) or None
        (causal); cache appended to. Returns logits (B, n', V') over the draft vocabulary."""
        out = self.model(inputs_embeds=self.embed(tokens), position_ids=positions,
                         attention_mask=attention_mask, cache=cache, use_cache=cache is not None,
                         logits_to_keep=logits_to_keep)
        return out.logits

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V') -> (..., V), -inf outside the draft vocabulary."""
        return to_target_vocab(logits, self.vocab_ids, self.target_vocab_size)


def mean_embedding(model: PreTrainedModel) -> torch.Tensor:
    """(H,) the mean token embedding: an untrained mask's input, the 'average token'."""
    return model.get_input_embeddings().weight.detach().float().mean(0)


class PardDrafter(BlockDrafter):
    """Proposes trees from one PARD forward per step (drafters.block for the tree); holds one
    sequence's draft cache (fork for another row of a batch)."""

    def __init__(self, draft: PardDraft, tree: TreePolicy, name: str = "pard"):
        super().__init__(draft, tree, name, draft.block_size, "drafter.block_size")
        self.begin(torch.empty(0, dtype=torch.long))

    def begin(self, prompt: torch.Tensor) -> None:
        self.cache = DynamicCache(config=self.draft.model.config)
        self.cached = torch.empty(0, dtype=torch.long)  # (T',) the tokens the cache holds

    def draft_cache_bytes(self) -> int:
        return allocated_bytes(self.cache)

    def block_marginals(self, ctx: DraftContext) -> torch.Tensor:
        return self.marginals(ctx.tokens.cpu())

    def marginals(self, tokens: torch.Tensor) -> torch.Tensor:
        """The block after tokens[-1] given (T,) committed tokens: (k, V) float CPU draft
        logits over the target's vocabulary, row d for depth d + 1. Feeds what the cache has
        not seen and the masks, then crops the masks' entries."""
        keep = min(common_prefix(self.cached, tokens), len(tokens) - 1)  # feed the root always
        if keep < len(self.cached):  # another sequence's, or a prompt rewound: drop the rest
            self.cache.crop(keep - len(self.cached))
        k = self.draft.block_size
        fed = torch.cat([tokens[keep:], torch.full((k - 1,), MASK, dtype=torch.long)])
        device = self.draft.mask_embedding.device
        positions = torch.arange(keep, keep + len(fed), device=device)
        logits = self.draft(fed[None].to(device), positions[None], cache=self.cache,
                            logits_to_keep=k)
        self.cache.crop(-(k - 1))  # the masks' entries: never committed
        self.cached = tokens.clone()
        self.forwards += 1
        return self.draft.to_target_vocab(logits[0].float().cpu())


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def write_mask(folder: Path, draft: PardDraft, mask_embedding: torch.Tensor | None = None
               ) -> None:
    """pard_mask.json: the block size and the (H,) mask embedding, as float32 values."""
    vector = draft.mask_embedding if mask_embedding is None else mask_embedding
    (folder / PARD_MASK_FILE).write_text(json.dumps({
        "block_size": draft.block_size,
        "mask_embedding": vector.detach().float().cpu().tolist()}) + "\n")


def read_mask(folder: str | Path) -> tuple[int, torch.Tensor] | None:
    """A PARD folder's (block_size, mask embedding (H,)), or None for a plain draft folder."""
    path = Path(folder) / PARD_MASK_FILE
    if not path.is_file():
        return None
    saved = read_json(path, "PARD mask")
    return int(saved["block_size"]), torch.tensor(saved["mask_embedding"])


def load_pard(path: str | Path, target: Target, block_size: int,
              allow_other_target: bool = False) -> PardDraft:
    """A PARD draft folder (trained with `python train.py drafter=pard`) on `target`, refused
    unless its tokenizer and vocabulary match the target's (draft_model.load_draft_model), it
    is a PARD draft, and it was trained for `block_size`."""
    # a model's folder passes, to be refused below with the way to adapt it to PARD
    check_kind(path, "the PARD drafter", ("pard", "draft_model", "hf_model"))
    saved = read_mask(path)
    if saved is None:
        raise ValueError(f"{path} holds no PARD draft ({PARD_MASK_FILE} missing): adapt a draft to "
                         f"PARD with python train.py drafter=pard drafter.path={path}")
    if saved[0] != block_size:
        raise ValueError(f"drafter.block_size={block_size}, but {path} was trained with "
                         f"block_size {saved[0]}: its masks learnt offsets 1..{saved[0] - 1}; "
                         f"set drafter.block_size={saved[0]}")
    model, vocab_ids = load_draft_model(path, target, allow_other_target)
    return PardDraft(model, block_size, vocab_ids, saved[1])


def from_config(cfg: Mapping, tree: TreePolicy, target: Target) -> PardDrafter:
    """conf/drafter/pard.yaml: `path: null` drafts with the target cut to num_layers layers
    (its mask untrained: the mean embedding), `path: <folder>` with a trained PARD draft."""
    config = pard_config(cfg)
    if config.path is None:
        model = truncated_copy(target.model, config.num_layers)
        draft = PardDraft(model, config.block_size, None, mean_embedding(model))
    else:
        draft = load_pard(config.path, target, config.block_size, config.allow_other_target)
    return PardDrafter(draft, tree, name=config.name)
