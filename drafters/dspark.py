"""DSpark: DFlash's one-forward block with a Markov head and a confidence head (DeepSeek's
DeepSpec, arXiv 2607.05147; vLLM's `dspark` method).

DFlash predicts every position of its block from the context alone, so depth 2 rarely survives
when depth 1 took another turn (docs/results/learning-curves.md). DSpark keeps the same block
backbone (drafters.dflash) and adds two small heads:

- the Markov head: a low-rank transition bias from the token before a position, added to that
  position's block logits. Position k's logits are base_k + W2 W1[x_{k-1}]: W1 (V, r) embeds
  the previous token (the root for k = 1, else the token drafted at k - 1; target vocabulary),
  W2 (r -> V') maps it onto the draft vocabulary. The backbone still runs once per step; the
  bias is a row of W1 and an r x V' product per drafted node, so each node's children depend
  on its own token: trees are filled node by node (static, dynamic, or best-first like DDTree);
- the confidence head: a linear map of [backbone output at k, W1[x_{k-1}]] to the logit of
  the chance that the target accepts position k given that the earlier ones were accepted. A
  `policy: confidence` tree (drafters.trees.confidence) verifies only the prefix that pays.

W2 starts at zero, so an untrained Markov head leaves DFlash's block as it is; markov_rank 0
is DFlash's block with the confidence head reading the backbone alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from drafters.config import typed_config
from drafters.dflash import (
    DFlashConfig,
    DFlashDraft,
    DFlashDrafter,
    check_block_config,
    configured_draft,
)
from drafters.trees import TreePolicy
from drafters.trees.confidence import ConfidenceChain
from drafters.trees.ddtree import DDTree
from drafters.trees.dynamic import DynamicTree, draft_log_probs
from drafters.trees.steps import fill_steps, run_steps
from verify.protocol import DraftContext
from verify.runtime.model import Target
from verify.sampling import SamplingParams
from verify.tree import TokenTree, TreeBuilder, TreeError


@dataclass
class DSparkConfig(DFlashConfig):
    """conf/drafter/dspark.yaml, typed: DFlash's keys and DSpark's heads."""

    name: str = "dspark"
    markov_rank: int = 64  # r of the Markov head's V x r and r x V' factors; 0: no Markov head
    confidence_head: bool = True  # the acceptance-confidence head (policy: confidence trees)
    # a fresh draft's W2 entries ~ N(0, std^2): 0 starts as DFlash's block; > 0 gives an
    # untrained draft a strong Markov head (the correctness evaluation's fresh drafts)
    markov_init_std: float = 0.0
    # Training only (train.dspark): the paper's three terms, each position weighted by decay
    ce_weight: float = 0.1  # cross-entropy against the target's most likely token
    l1_weight: float = 0.9  # ||q - p||_1 to the target's distribution (twice total variation)
    confidence_weight: float = 1.0  # BCE of the confidence against 1 - ||q - p||_1 / 2


def head_arguments(config: DSparkConfig) -> dict:
    """DSparkDraft's own arguments for a fresh draft of `config` (DFlashDraft's aside)."""
    return {"markov_rank": config.markov_rank, "confidence_head": config.confidence_head,
            "markov_init_std": config.markov_init_std}


def dspark_config(cfg: Mapping) -> DSparkConfig:
    config: DSparkConfig = check_block_config(typed_config(DSparkConfig, cfg, "DSpark"))
    if config.markov_init_std < 0:
        raise ValueError(f"drafter.markov_init_std must be >= 0, got {config.markov_init_std}")
    if config.markov_rank < 0:
        raise ValueError(f"drafter.markov_rank must be >= 0 (0: no Markov head), got "
                         f"{config.markov_rank}")
    for key in ("ce_weight", "l1_weight", "confidence_weight"):
        if getattr(config, key) < 0:
            raise ValueError(f"drafter.{key} must be >= 0, got {getattr(config, key)}")
    if config.ce_weight == config.l1_weight == 0:
        raise ValueError("drafter.ce_weight and drafter.l1_weight are both 0: the draft's "
                         "logits would learn nothing")
    return config


class DSparkDraft(DFlashDraft):
    """DFlashDraft plus markov_w1 (V, r) embedding the previous token, markov_w2 (r -> V')
    its logit bias (both absent at rank 0), and `confidence` (H + r -> 1) or None."""

    KIND, NAME = "dspark", "DSpark"

    def __init__(self, target: PreTrainedModel, feature_layers: tuple[int, ...],
                 block_size: int, layers: int, vocab_ids: torch.Tensor | None = None,
                 markov_rank: int = 64, confidence_head: bool = True,
                 markov_init_std: float = 0.0):
        super().__init__(target, feature_layers, block_size, layers, vocab_ids)
        hidden = self.lm_head.weight.shape[1]
        self.markov_rank = markov_rank
        self.markov_w1 = self.markov_w2 = self.confidence = None
        if markov_rank:
            self.markov_w1 = nn.Embedding(self.target_vocab_size, markov_rank)
            nn.init.normal_(self.markov_w1.weight, std=markov_rank ** -0.5)
            self.markov_w2 = nn.Linear(markov_rank, self.vocab_size, bias=False)
            # zero: an untrained head leaves DFlash's block unchanged
            nn.init.normal_(self.markov_w2.weight, std=markov_init_std) if markov_init_std \
                else nn.init.zeros_(self.markov_w2.weight)
        if confidence_head:  # no bias: vLLM's dspark layout has none
            self.confidence = nn.Linear(hidden + markov_rank, 1, bias=False)
        self.to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype)

    def markov_bias(self, previous: torch.Tensor) -> torch.Tensor | float:
        """(...) long previous tokens (target ids) -> their (..., V') logit bias; 0.0 without
        a Markov head."""
        if self.markov_w1 is None:
            return 0.0
        return self.markov_w2(self.markov_w1(previous))

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """(..., H) backbone outputs and (...) previous tokens -> (...) logits of the chance
        that each position is accepted given the earlier ones were."""
        if self.confidence is None:
            raise TreeError("this DSpark draft has no confidence head (drafter.confidence_head="
                            "false): a policy: confidence tree needs one")
        inputs = hidden.to(self.confidence.weight.dtype)
        if self.markov_w1 is not None:
            inputs = torch.cat([inputs, self.markov_w1(previous).to(inputs.dtype)], -1)
        return self.confidence(inputs)[..., 0]

    @property
    def hyperparameters(self) -> dict:
        return {**super().hyperparameters, "markov_rank": self.markov_rank,
                "confidence_head": self.confidence is not None}

    @classmethod
    def rebuilt(cls, target: PreTrainedModel, config: Mapping,
                vocab_ids: torch.Tensor | None) -> DSparkDraft:
        return cls(target, tuple(config["feature_layers"]), config["block_size"],
                   config["num_layers"], vocab_ids, config["markov_rank"],
                   config["confidence_head"])


class DSparkProposals:
    """`propose` for a drafter whose `block_outputs(ctx)` gives one DSpark block forward's
    backbone outputs (D, H) and base logits (D, V'): the torch drafter and the OpenVINO one."""

    draft: DSparkDraft
    tree: TreePolicy

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> TokenTree:
        hidden, base = self.block_outputs(ctx)
        return dspark_tree(self.draft, self.tree, int(ctx.tokens[-1]), hidden, base,
                           ctx.params, ctx.generator)


class DSparkDrafter(DSparkProposals, DFlashDrafter):
    """A DFlashDrafter whose trees read the Markov head node by node (`dspark_tree`)."""


def dspark_tree(draft: DSparkDraft, tree: TreePolicy, root: int, hidden: torch.Tensor,
                base: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> TokenTree:
    """The tree `tree` describes below `root` from one block forward: hidden (D, H) and base
    logits (D, V') over the draft vocabulary, row d for depth d + 1. A node at depth d with
    token t proposes its children from base[d] + markov_bias(t)."""
    rows = MarkovRows(draft, base)
    if isinstance(tree, ConfidenceChain):
        return tree.cut(confidence_chain(draft, rows, hidden, root, tree.depth))
    if isinstance(tree, DDTree):
        return tree.grow_over(root, lambda depth, token: rows.ranked(depth, token, params,
                                                                     tree.total_tokens),
                              len(base))
    if isinstance(tree, DynamicTree):
        steps = tree.search_steps(root, draft_log_probs(rows.logits([0], [root]), params)[0])
        candidates = run_steps(steps, lambda request: draft_log_probs(
            rows.logits(*_depths_tokens(*request)), params))
        return candidates.build(tree.rerank(candidates))
    steps = fill_steps(tree, root, rows.logits([0], [root])[0], len(base), params, generator)
    return run_steps(steps, lambda request: rows.logits(*_depths_tokens(*request)))


def _depths_tokens(builder: TreeBuilder, nodes: list[int]) -> tuple[list[int], list[int]]:
    return [builder.depth(n) for n in nodes], [builder.tokens[n] for n in nodes]


class MarkovRows:
    """The rows a node's children come from: base[depth] + the Markov bias of its token."""

    def __init__(self, draft: DSparkDraft, base: torch.Tensor):
        self.draft, self.base = draft, base
        self.weight = draft.lm_head.weight

    def draft_logits(self, depths: list[int], tokens: list[int]) -> torch.Tensor:
        """(n, V') float CPU logits over the draft vocabulary."""
        previous = torch.tensor(tokens, device=self.weight.device)
        bias = self.draft.markov_bias(previous)
        bias = bias.float().cpu() if torch.is_tensor(bias) else bias
        return self.base[depths] + bias

    def logits(self, depths: list[int], tokens: list[int]) -> torch.Tensor:
        """(n, V) over the target's vocabulary, -inf outside the draft's."""
        return self.draft.to_target_vocab(self.draft_logits(depths, tokens))

    def target_id(self, index: int) -> int:
        """The target's id of draft-vocabulary entry `index`."""
        ids = self.draft.vocab_ids
        return index if ids is None else int(ids[index])

    def ranked(self, depth: int, token: int, params: SamplingParams, count: int
               ) -> tuple[list[float], list[int]]:
        """The `count` best children of a node at `depth` holding `token`: log-probabilities
        and target ids, best first (warped as drafts are when sampling)."""
        log_probs = draft_log_probs(self.draft_logits([depth], [token]), params)[0]
        values, index = log_probs.topk(min(count, len(log_probs)))
        ids = self.draft.vocab_ids
        tokens = index if ids is None else ids.cpu()[index]
        return values.tolist(), tokens.tolist()


def confidence_chain(draft: DSparkDraft, rows: MarkovRows, hidden: torch.Tensor, root: int,
                     depth: int | None) -> TokenTree:
    """The top-1 chain below `root`, up to `depth` drafts (None: the block's), each node
    scored by the chance its prefix survives: the product of the confidence head's
    per-position acceptance chances."""
    builder = TreeBuilder(root, scored=True)
    previous, node, log_survival = root, 0, 0.0
    device = draft.lm_head.weight.device
    for k in range(len(rows.base) if depth is None else min(depth, len(rows.base))):
        token = rows.target_id(int(rows.draft_logits([k], [previous])[0].argmax()))
        confidence = draft.confidence_logits(hidden[k].to(device),
                                             torch.tensor(previous, device=device))
        log_survival += float(nn.functional.logsigmoid(confidence.float()))
        node = builder.add(node, token, log_survival)
        previous = token
    return builder.build()


def from_config(cfg: Mapping, tree: TreePolicy, target: Target) -> DSparkDrafter:
    """conf/drafter/dspark.yaml: a fresh (untrained) draft, or `checkpoint: <folder>`."""
    config = dspark_config(cfg)
    draft = configured_draft(config, target, DSparkDraft, **head_arguments(config))
    if isinstance(tree, ConfidenceChain) and draft.confidence is None:
        raise TreeError("tree policy 'confidence' cuts chains by DSpark's confidence head, "
                        f"which this draft lacks ({config.checkpoint or 'a fresh draft'} with "
                        "confidence_head false): give another tree")
    return DSparkDrafter(draft, tree, name=config.name)
