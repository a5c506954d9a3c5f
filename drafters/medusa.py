"""Medusa drafting: K extra decoding heads on the target's last hidden state (Cai et al. 2024).

The target's own LM head turns the hidden state at position t into a prediction for t + 1; Medusa
head k (0-based) turns the same state into a prediction for t + 2 + k. One pass of the heads over
the state that predicted the tree's root therefore gives a distribution for every tree depth:
depth d draws from head d - 1. The heads do not see the drafted path, so every node at one depth
draws its children from the same distribution.

Each head is a stack of residual blocks x + SiLU(W x + b), zero-initialised so that a fresh head
repeats the target's own prediction, followed by a vocabulary projection initialised from the
target's LM head: the target's module itself, frozen (`share_lm_head`), or a trainable copy.

A draft vocabulary (drafters.vocab) restricts the projection to the rows of the tokens the
target actually writes: on a CPU that is what makes heads affordable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drafters.base import StatelessBatchDrafter
from drafters.checkpoint import (
    check_kind,
    check_target,
    read_config,
    save_module,
    target_record,
)
from drafters.config import typed_config
from drafters.trees.steps import add_children, check_depth
from drafters.vocab import check_vocab_ids, copy_linear, draft_index, to_target_vocab
from verify.protocol import DraftContext
from verify.runtime.features import LAST
from verify.runtime.files import load_tensors
from verify.runtime.model import Target
from verify.tree import TokenTree, TreeBuilder, TreeTopology

WEIGHTS_FILE = "heads.safetensors"
ADAPTER_DIR = "adapter"  # Medusa-2: the target's LoRA adapter, trained with the heads


@dataclass
class MedusaConfig:
    """conf/drafter/medusa.yaml, checked: the drafter keys plus the training-only ones."""

    name: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True
    draft_vocab_size: int | None = 8192  # null: the target's whole vocabulary
    checkpoint: str | None = None
    allow_other_target: bool = False  # load a checkpoint whose target's fingerprint differs
    step: str | None = None  # torch | openvino; null: openvino when target.step=openvino
    init_heads: str | None = None  # heads to start from, e.g. Medusa-1's for Medusa-2's stage 2
    variant: str = "medusa1"  # medusa1: frozen target | medusa2: + a LoRA adapter on it
    head_decay: float = 0.8  # head k's loss weight is head_decay ** k
    # Heads' labels on prefilled text (ShareGPT): "target", the target's own greedy token at each
    # position (teacher-forced on the text); "text", the text's tokens. Distilled answers are
    # the target's tokens either way.
    labels: str = "target"
    head_loss_weight: float = 0.2  # Medusa-2: the heads' loss next to the LM loss
    kl_weight: float = 0.0  # Medusa-2: KL(original target || adapted target) per token
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: Any = "all-linear"  # peft's choice: every linear layer but the LM head


def medusa_config(drafter: Mapping) -> MedusaConfig:
    """Type-check the drafter group's keys against MedusaConfig (a typo fails here)."""
    cfg: MedusaConfig = typed_config(MedusaConfig, drafter, "Medusa")
    if cfg.variant not in ("medusa1", "medusa2"):
        raise ValueError(f"drafter.variant must be medusa1 or medusa2, got {cfg.variant!r}")
    if cfg.labels not in ("target", "text"):
        raise ValueError(f"drafter.labels must be target or text, got {cfg.labels!r}")
    return cfg


class ResBlock(nn.Module):
    """x + SiLU(W x + b) on (..., H); W and b start at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads over the target's LM head `lm_head` (weight (V, H)).

    share_lm_head=True: every head projects with the target's frozen weights, kept out of this
    module's parameters and state_dict (they belong to the target). False: each head gets its
    own trainable copy, initialised from them. vocab_ids (V',): the sorted token ids the heads
    may propose (a draft vocabulary); None: all V. Blocks and copies take `lm_head`'s device
    and dtype.
    """

    def __init__(self, lm_head: nn.Module, num_heads: int, num_layers: int,
                 share_lm_head: bool = True, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads} heads "
                             f"of {num_layers} layers")
        weight = lm_head.weight
        self.target_vocab_size, self.hidden_size = weight.shape
        self.num_heads, self.num_layers, self.share_lm_head = num_heads, num_layers, share_lm_head
        if vocab_ids is not None:
            vocab_ids = check_vocab_ids(vocab_ids, self.target_vocab_size).to(weight.device)
        self.register_buffer("vocab_ids", vocab_ids)  # saved with the heads; None: not at all
        # A fresh block per layer and per head: `[ResBlock(h)] * n` would share one.
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(self.hidden_size) for _ in range(num_layers)))
            for _ in range(num_heads)
        ).to(device=weight.device, dtype=weight.dtype)
        if share_lm_head:
            # In a tuple, the module is not registered: no parameters, no state_dict entries.
            # With a draft vocabulary, a frozen copy of the target's rows for it.
            shared = (lm_head if vocab_ids is None
                      else copy_linear(lm_head, vocab_ids).requires_grad_(False))
            self._shared_lm_head = (shared,)
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(copy_linear(lm_head, vocab_ids)
                                          for _ in range(num_heads))

    def share_projection(self, weight: torch.Tensor) -> None:
        """Project every head with `weight` (V', H), frozen, instead of the target's rows:
        heads exported with a shared projection that is not this target's (a fine-tune's)."""
        if not self.share_lm_head:
            raise ValueError("these heads have their own projections, not a shared one")
        if weight.shape != (self.vocab_size, self.hidden_size):
            raise ValueError(f"a shared projection is ({self.vocab_size}, {self.hidden_size}), "
                             f"got {tuple(weight.shape)}")
        projection = nn.Linear(self.hidden_size, self.vocab_size, bias=False,
                               device=weight.device, dtype=weight.dtype)
        projection.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self._shared_lm_head = (projection,)

    @property
    def vocab_size(self) -> int:
        """Size of the heads' output: the draft vocabulary, or the target's whole one."""
        return self.target_vocab_size if self.vocab_ids is None else len(self.vocab_ids)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden (..., H) -> logits (K, ..., V') over the draft vocabulary; head k predicts
        k + 2 positions ahead. num_heads: run only the first ones (a shallower tree needs no
        more, and each costs a vocabulary projection)."""
        blocks = self.blocks[:num_heads]
        if len(blocks) == 0:  # a root-only tree drafts nothing
            return hidden.new_empty((0, *hidden.shape[:-1], self.vocab_size))
        return torch.stack([self.head_logits(hidden, k) for k in range(len(blocks))])

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head k alone: hidden (..., H) -> logits (..., V'). Training and evaluation go head
        by head, so that one (N, V') matrix at a time is alive."""
        return self.head_lm(k)(self.blocks[k](hidden))

    def head_lm(self, k: int) -> nn.Module:
        """The vocabulary projection of head k."""
        return self._shared_lm_head[0] if self.lm_heads is None else self.lm_heads[k]

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V') draft-vocabulary logits -> (..., V), -inf where the heads cannot propose."""
        return to_target_vocab(logits, self.vocab_ids, self.target_vocab_size)

    def draft_index(self) -> torch.Tensor:
        """(V,) position of each target token in the draft vocabulary; -1 where it has none."""
        return draft_index(self.vocab_ids, self.target_vocab_size)

    @property
    def hyperparameters(self) -> dict:
        """What rebuilds these heads on a target, as saved in a checkpoint's config."""
        return {"num_heads": self.num_heads, "num_layers": self.num_layers,
                "share_lm_head": self.share_lm_head,
                "draft_vocab_size": None if self.vocab_ids is None else self.vocab_size}


class MedusaDrafter(StatelessBatchDrafter):
    """Fills a static topology from one pass of Medusa heads over the root's predicting state.

    The child of rank r under a depth-(d-1) node is head d-1's r-th proposal: its top tokens
    (greedy), or draws without replacement from its warped distribution (sampling), drawn
    afresh for each parent and recorded as that parent's draft distribution. Nothing is kept
    between steps: the heads only look at the latest hidden state, which carries the accepted
    path.
    """

    feature_layers = LAST  # the state the target's LM head reads

    def __init__(self, heads: MedusaHeads, topology: TreeTopology, name: str = "medusa"):
        self.max_depth = heads.num_heads
        check_depth(topology, self.max_depth, name)
        self.heads = heads.eval()
        self.topology = topology
        self.name = name

    @torch.no_grad()
    def propose_batch(self, ctxs: list[DraftContext]) -> list[TokenTree]:
        """One tree per row from one pass of the heads over the B rows' states: each head's
        vocabulary projection reads its weights once for the batch, not once per row. A tree
        has fewer nodes than the topology where a head's distribution has too few tokens with
        mass."""
        if any(ctx.features is None for ctx in ctxs):
            raise ValueError("the Medusa drafter needs the target's last hidden state "
                             "(ctx.features): the loop computes the drafter's feature_layers, "
                             "as verify.loop.generate does")
        weight = self.heads.head_lm(0).weight
        hidden = torch.stack([ctx.features[-1].to(weight) for ctx in ctxs])  # (B, H)
        logits = self.heads.to_target_vocab(self._head_logits(hidden))  # (depth, B, V)
        return [self._fill(int(ctx.tokens[-1]), logits[:, b], ctx) for b, ctx in enumerate(ctxs)]

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) states -> (depth, B, V') float CPU logits of the heads the tree needs."""
        return self.heads(hidden, num_heads=self.topology.depth).float().cpu()

    def _fill(self, root: int, logits: torch.Tensor, ctx: DraftContext) -> TokenTree:
        """Place each topology node's children, parents first; (K, V) logits per depth."""
        builder = TreeBuilder(root)
        placed = {0: 0}  # topology node -> tree node
        for node in range(self.topology.size):
            kids = self.topology.children(node)
            if node not in placed or not kids:
                continue  # a parent left out (too few tokens with mass) leaves out its subtree
            depth = len(self.topology.choices[node - 1]) if node else 0  # node i: choice i-1
            add_children(builder, self.topology, placed, node, logits[depth], ctx.params,
                         ctx.generator)
        return builder.build()


def save_heads(heads: MedusaHeads, folder: str | Path, target: Target,
               extra: Callable[[Path], None] | None = None, state: dict | None = None) -> None:
    """Write `heads` to `folder` (heads.safetensors + config.json recording the target and its
    fingerprint), atomically, replacing what was there. `extra(tmp)` may add files (a training
    checkpoint's state); `state`: their state dict as gathered by training under fsdp.

    Only the heads' own weights are saved: a shared LM head belongs to the target.
    """
    config = {"target": target_record(target, heads.hidden_size, heads.target_vocab_size),
              **heads.hyperparameters}
    save_module(heads, folder, WEIGHTS_FILE, config, extra, state)


def load_heads(folder: str | Path, target: Target, allow_other_target: bool = False
               ) -> MedusaHeads:
    """Heads saved by `save_heads`, on `target`'s LM head; ValueError when the checkpoint was
    made for another target (drafters.checkpoint.check_target, as EAGLE's and the draft model's)
    or does not hold exactly the heads' tensors."""
    folder = Path(folder)
    check_kind(folder, "the Medusa drafter", ("medusa",))
    config = read_config(folder)
    lm_head = target.model.get_output_embeddings()
    check_target(config["target"], target, folder, "Medusa heads", allow_other_target)
    _check_adapter(folder, target)
    state = load_tensors(folder / WEIGHTS_FILE, device=str(lm_head.weight.device))
    heads = MedusaHeads(lm_head, config["num_heads"], config["num_layers"],
                        config["share_lm_head"], vocab_ids=state.get("vocab_ids"))
    heads.load_state_dict(state)  # strict: missing, unexpected or misshapen tensors are named
    return heads


def _check_adapter(folder: Path, target: Target) -> None:
    """Medusa-2 heads read the hidden states of the target with its adapter merged in."""
    adapter = folder / ADAPTER_DIR
    if adapter.is_dir() and (target.adapter is None
                             or Path(target.adapter).resolve() != adapter.resolve()):
        raise ValueError(f"the Medusa heads in {folder} were trained together with a LoRA "
                         f"adapter on the target (Medusa-2): load the target with "
                         f"target.adapter={adapter}")


def from_config(cfg: Mapping, topology: TreeTopology, target: Target) -> MedusaDrafter:
    """conf/drafter/medusa.yaml: fresh heads (`num_heads`, `num_layers`, `share_lm_head`) on the
    target, or `checkpoint: <folder>` to load trained ones (whose own config then applies)."""
    config = medusa_config(cfg)
    if config.checkpoint:
        heads = load_heads(config.checkpoint, target, config.allow_other_target)
    else:
        heads = MedusaHeads(target.model.get_output_embeddings(), config.num_heads,
                            config.num_layers, config.share_lm_head)
    return MedusaDrafter(heads, topology, name=config.name)
