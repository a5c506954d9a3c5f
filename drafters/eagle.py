"""EAGLE drafting: autoregression over the target's features (Li et al. 2024, EAGLE-1/2/3).

The target's hidden state at position j (its "feature" f_j) predicted token j + 1. EAGLE's draft
reads (f_j, embedding of token j + 1) at position j and predicts the next feature, from which a
vocabulary projection gives token j + 2: it knows which token was actually sampled, which a
Medusa head does not, and it can go on from its own predicted features, one tree level at a
time, with its own KV cache (drafters.engine).

- EAGLE-1 (`variant: eagle1`): f is the target's last (normed) state; the draft is a linear
  layer over [embedding, feature] (2H -> H) and one decoder layer of the target's own
  architecture, built from its config (no copied modeling file); trained with a feature
  regression plus cross-entropy. EAGLE-2 is a tree policy (drafters.trees.dynamic) on top.
- EAGLE-3 (`variant: eagle3`): f concatenates a low, a middle and a high layer, fused 3H -> H;
  trained on its own unrolled outputs (training-time test) with cross-entropy only, and a
  trainable head over a reduced draft vocabulary. Its draft layer (`layout: eagle3`, the
  default) keeps embedding and feature apart until attention, as EAGLE-3's code and the
  serving engines do (drafters.eagle3_layer); `layout: fused_input` is EAGLE-1's layer, what
  EAGLE-3 drafts trained here before used (their checkpoints load as such).

Deeper tree nodes read the draft's own output of their parent in place of a target feature.
At each step the target's real features of the accepted path replace those guesses: the draft
re-runs the accepted rows (one forward, which also predicts the first level), so its cache only
ever holds entries built from real features. The target's token embedding is shared, frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, PreTrainedModel

from drafters.checkpoint import (
    EAGLE_KINDS,
    check_kind,
    check_target,
    checkpoint_kind,
    eagle_variant,
    read_config,
    save_module,
    target_record,
)
from drafters.config import shallow_config, typed_config
from drafters.eagle3_layer import Eagle3Layer, eagle3_layer_config
from drafters.engine import EngineDrafter, LevelAnswer, LevelRequest
from drafters.speculators import check_eagle3_forward, load_eagle3_weights, read_speculators
from drafters.trees.dynamic import DynamicTree
from drafters.vocab import check_vocab_ids, copy_linear, to_target_vocab
from verify.protocol import DraftContext
from verify.runtime.features import LAST, eagle3_layers, num_layers, resolve_layers
from verify.runtime.files import load_tensors
from verify.runtime.model import Target, context_window
from verify.tree import TreeTopology

VARIANTS = ("eagle1", "eagle3")
INPUTS = ("both", "tokens", "features")  # what the draft reads; the last two are ablations
LAYOUTS = ("fused_input", "eagle3")  # EAGLE-1's draft layer, EAGLE-3's (drafters.eagle3_layer)
WEIGHTS_FILE = "draft.safetensors"


@dataclass
class EagleConfig:
    """conf/drafter/eagle.yaml and eagle3.yaml, typed: the only defaults of these keys."""

    name: str = "eagle"
    variant: str = "eagle1"  # eagle1: last-layer features | eagle3: fused low/mid/high
    feature_layers: list[int] | None = None  # null: (-1,) for eagle1, eagle3_layers() for eagle3
    draft_vocab_size: int | None = 8192  # null: the target's whole vocabulary (slow on CPU)
    train_lm_head: bool = False  # eagle3: the reduced head learns (starts from the target's rows)
    inputs: str = "both"  # the EAGLE paper's input ablation: both | tokens | features (one zeroed)
    layout: str | None = "fused_input"  # eagle3: EAGLE-3's layer; null: the variant's own
    checkpoint: str | None = None  # a trained draft (python train.py drafter=eagle ...)
    allow_other_target: bool = False  # load a checkpoint whose target's fingerprint differs
    # Training only (train.eagle):
    ttt_steps: int = 1  # unrolled draft steps per position (EAGLE-3's training-time test)
    step_decay: float = 0.8  # unrolled step s's loss weight: step_decay ** s
    feature_weight: float = 1.0  # smooth-L1 on the next feature (EAGLE-1; 0 for EAGLE-3)
    ce_weight: float = 0.1  # cross-entropy to the target's next-token distribution
    noise: float = 0.1  # uniform noise U(-noise, noise) on input features
    step: str | None = None  # torch | openvino; null: openvino when target.step=openvino


def eagle_config(cfg: Mapping) -> EagleConfig:
    """conf/drafter/eagle*.yaml checked against EagleConfig."""
    config: EagleConfig = typed_config(EagleConfig, cfg, "EAGLE")
    if config.variant not in VARIANTS:
        raise ValueError(f"drafter.variant must be one of {VARIANTS}, got {config.variant!r}")
    if config.inputs not in INPUTS:
        raise ValueError(f"drafter.inputs must be one of {INPUTS}, got {config.inputs!r}")
    if config.layout is None:
        config.layout = default_layout(config.variant)
    if config.layout not in LAYOUTS:
        raise ValueError(f"drafter.layout must be one of {LAYOUTS}, got {config.layout!r}")
    return config


def default_layout(variant: str) -> str:
    """The draft layer a variant gets when the config names none: each paper's own."""
    return "eagle3" if variant == "eagle3" else "fused_input"


def default_layers(variant: str, total_layers: int) -> tuple[int, ...]:
    """The feature layers a variant reads when the config names none."""
    return LAST if variant == "eagle1" else eagle3_layers(total_layers)


class EagleDraft(nn.Module):
    """The draft network for a target model.

    feature_layers: absolute hidden-state indices it reads (F of them); vocab_ids (V',) its
    draft vocabulary (None: all V). fuse (F*H -> H, EAGLE-3 only), lm_head (H -> V'), and the
    layer by `layout`: "fused_input", input_proj ([emb, g] 2H -> H) and body (one decoder
    layer + final norm of the target's architecture); "eagle3", body = Eagle3Layer.
    inputs: "both" (EAGLE), or the paper's ablations "tokens" (features zeroed: a one-layer
    draft LM over tokens) and "features" (the shifted token's embedding zeroed).
    """

    def __init__(self, target: PreTrainedModel, feature_layers: tuple[int, ...],
                 vocab_ids: torch.Tensor | None = None, train_lm_head: bool = False,
                 inputs: str = "both", layout: str = "fused_input"):
        super().__init__()
        if inputs not in INPUTS:
            raise ValueError(f"inputs must be one of {INPUTS}, got {inputs!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.inputs, self.layout = inputs, layout
        config, lm_head = target.config, target.get_output_embeddings()
        self.target_vocab_size, hidden = lm_head.weight.shape
        self.feature_layers = resolve_layers(feature_layers, num_layers(config))
        if vocab_ids is not None:
            vocab_ids = check_vocab_ids(vocab_ids, self.target_vocab_size)
        self.register_buffer("vocab_ids", vocab_ids)
        width = len(self.feature_layers) * hidden
        self.fuse = nn.Linear(width, hidden, bias=False) if width != hidden else None
        if layout == "eagle3":
            self.input_proj = None
            self.body = Eagle3Layer(eagle3_layer_config(config))
        else:
            self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
            self.body = AutoModel.from_config(_body_config(config))
        self.lm_head = copy_linear(lm_head, vocab_ids).requires_grad_(train_lm_head)
        self._embed = (target.get_input_embeddings(),)  # the target's, frozen: not saved here
        self.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    @property
    def vocab_size(self) -> int:
        return self.target_vocab_size if self.vocab_ids is None else len(self.vocab_ids)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """(..., F * H) target features -> (..., H), the draft's input feature."""
        return features if self.fuse is None else self.fuse(features)

    def forward(self, inputs: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """inputs (B, n, H): fused target features or the draft's own outputs; tokens (B, n)
        the tokens that follow them; positions (B, n). attention_mask: None (causal), (B,
        cached + n) padding, or an additive (B, 1, n, cached + n) tree mask. Returns the
        predicted next features (B, n, H) (the eagle3 layout: before its final norm); with
        `cache`, their keys/values are appended."""
        embedded = self._embed[0](tokens).to(inputs.dtype)
        if self.inputs == "tokens":
            inputs = torch.zeros_like(inputs)
        elif self.inputs == "features":
            embedded = torch.zeros_like(embedded)
        if self.layout == "eagle3":
            return self.body(embedded, inputs, positions, attention_mask, cache)
        x = self.input_proj(torch.cat([embedded, inputs], dim=-1))
        out = self.body(inputs_embeds=x, position_ids=positions, attention_mask=attention_mask,
                        cache=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V') draft-vocabulary logits -> (..., V) over the target's, -inf outside."""
        return to_target_vocab(logits, self.vocab_ids, self.target_vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) `forward` outputs -> (..., V') over the draft vocabulary."""
        return self.lm_head(self.body.norm(hidden) if self.layout == "eagle3" else hidden)

    @property
    def variant(self) -> str:
        """Which EAGLE this draft is (eagle_variant)."""
        return eagle_variant(self.feature_layers, self.layout)

    @property
    def hyperparameters(self) -> dict:
        """What rebuilds this draft on a target, as saved in a checkpoint's config. `inputs`
        only for an ablation: checkpoints from before the setting read as "both" and resume."""
        settings = {"feature_layers": list(self.feature_layers),
                    "draft_vocab_size": None if self.vocab_ids is None else self.vocab_size,
                    "train_lm_head": bool(self.lm_head.weight.requires_grad)}
        if self.layout != "fused_input":  # older checkpoints have none: they read as fused_input
            settings["layout"] = self.layout
        return settings if self.inputs == "both" else {**settings, "inputs": self.inputs}


def _body_config(config):
    """One decoder layer of the target's architecture; the draft feeds embeddings itself, so
    the body's own token table is cut to one row."""
    body = shallow_config(config, 1)
    body.vocab_size = 1
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(body, key, None)
    return body


class EagleDrafter(EngineDrafter):
    """Proposes a static topology (level by level) or an EAGLE-2 dynamic tree from the draft.

    Static trees with sampling draw each node's children without replacement from the draft's
    warped distribution and record it (exact tree sampling); dynamic trees pick children by
    top-k (see drafters.trees.dynamic for why). A batch of B sequences drafts together
    (`begin_batch`, `propose_batch`): one draft forward per tree level for all rows.
    """

    # The trees' entries were built on the draft's own features: dropped once drafted, the
    # next catch-up re-runs the accepted path on the target's real ones.
    commits_accepted_path = False

    def __init__(self, draft: EagleDraft, tree: TreeTopology | DynamicTree, name: str = "eagle"):
        super().__init__(draft.body.config, tree, name)
        self.draft = draft.eval()
        self.feature_layers = draft.feature_layers

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return self.draft.vocab_ids

    @property
    def target_vocab_size(self) -> int:
        return self.draft.target_vocab_size

    def _catch_up(self, ctxs: list[DraftContext]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row the rows the target just computed features for: (f_j, token j + 1)
        for its k positions T - 1 - k .. T - 2, all rows in one forward. Returns the roots'
        predicted features (B, H) and the float CPU draft-vocabulary logits (B, V') of their
        children."""
        weight = self.draft.lm_head.weight
        starts, counts = self._feature_spans(ctxs)
        self.engine.crop_rows(starts)
        if len(ctxs) > 1 and self.engine.size == 0:  # the prompts: each row alone, no padding
            last = self._start_rows(ctxs, counts)
        else:
            positions, mask = self.engine.chains(counts, weight.dtype)
            inputs = torch.zeros(len(ctxs), positions.shape[1], weight.shape[1],
                                 dtype=weight.dtype, device=weight.device)
            tokens = torch.zeros(positions.shape, dtype=torch.long)
            for row, (ctx, start, count) in enumerate(zip(ctxs, starts, counts)):
                inputs[row, :count] = self.draft.fuse_features(ctx.features.to(weight))
                tokens[row, :count] = ctx.tokens[start + 1:]
            hidden = self.draft(inputs, tokens.to(weight.device), positions.to(weight.device),
                                None if mask is None else mask.to(weight.device),
                                cache=self.engine.cache)  # (B, K, H)
            self.engine.commit_chains(counts)
            last = hidden[torch.arange(len(ctxs)), torch.tensor(counts) - 1]
        return last, self.draft.logits(last).float().cpu()

    def _feature_spans(self, ctxs: list[DraftContext]) -> tuple[list[int], list[int]]:
        """Per row, the first position its features cover and how many (the rows the catch-up
        feeds), checked against what the cache holds."""
        starts, counts = [], []
        for row, ctx in enumerate(ctxs):
            if ctx.features is None:
                raise ValueError(f"{self.name} needs the target's features (ctx.features) at "
                                 f"layers {self.feature_layers}; verify.loop.generate computes "
                                 "them")
            count, length = len(ctx.features), len(ctx.tokens)
            start = length - 1 - count
            if not 0 <= start <= int(self.engine.lengths[row]):
                raise ValueError(f"{self.name} got features for positions {start}..{length - 2}"
                                 f" but holds {int(self.engine.lengths[row])}: call begin() for "
                                 "a new sequence")
            starts.append(start)
            counts.append(count)
        return starts, counts

    def _start_rows(self, ctxs: list[DraftContext], counts: list[int]) -> torch.Tensor:
        """The first catch-up of an empty engine, row by row (DraftEngine.start_rows): every
        position from 0 on. Returns the roots' predicted features (B, H)."""
        weight = self.draft.lm_head.weight
        last = []

        def run_row(row: int, cache) -> None:
            ctx = ctxs[row]
            inputs = self.draft.fuse_features(ctx.features.to(weight))[None]  # (1, k, H)
            tokens = ctx.tokens[1:].to(weight.device)[None]
            positions = torch.arange(counts[row], device=weight.device)[None]
            last.append(self.draft(inputs, tokens, positions, cache=cache)[0, -1])

        self.engine.start_rows(counts, run_row)
        return torch.stack(last)

    def _depth_limit(self, ctx: DraftContext) -> int:
        """The tree's depth, or 0 (no tree) where its deepest node (position T - 2 + depth)
        would leave the draft's position range (GPT-2's position table would overflow)."""
        window = context_window(self.draft.body)
        fits = window is None or len(ctx.tokens) - 2 + self.tree.depth < window
        return self.tree.depth if fits else 0

    def _forward_level(self, requests: dict[int, LevelRequest]) -> dict[int, LevelAnswer]:
        """One tree level of every asking row through the draft's cache, in one forward: each
        node's token on its parent's predicted feature. Returns per row the nodes' own
        predicted features (n_b, H) and their float CPU draft-vocabulary logits (n_b, V')."""
        weight = self.draft.lm_head.weight
        rows = range(self.engine.rows)
        positions, mask = self.engine.level(
            [requests[row].paths if row in requests else [] for row in rows], weight.dtype)
        inputs = torch.zeros(len(rows), positions.shape[1], weight.shape[1], dtype=weight.dtype,
                             device=weight.device)
        tokens = torch.zeros(positions.shape, dtype=torch.long)
        for row, request in requests.items():
            inputs[row, :len(request.tokens)] = request.parent_states
            tokens[row, :len(request.tokens)] = torch.tensor(request.tokens)
        out = self.draft(inputs, tokens.to(weight.device), positions.to(weight.device),
                         mask.to(weight.device), cache=self.engine.cache)  # (B, n, H)
        real = [out[row, :len(requests[row].tokens)] for row in requests]
        logits = self.draft.logits(torch.cat(real)).float().cpu().split([len(r) for r in real])
        return {row: (hidden, row_logits)
                for row, hidden, row_logits in zip(requests, real, logits)}


def save_draft(draft: EagleDraft, folder: str | Path, target: Target,
               extra: Callable[[Path], None] | None = None, state: dict | None = None) -> None:
    """Write the draft (draft.safetensors + config.json recording its target and the target's
    fingerprint) to `folder`, atomically, replacing what was there; `extra(tmp)` may add
    files (training state); `state`: its state dict as gathered by training under fsdp."""
    hidden = draft.lm_head.weight.shape[1]
    config = {"target": target_record(target, hidden, draft.target_vocab_size),
              **draft.hyperparameters}
    save_module(draft, folder, WEIGHTS_FILE, config, extra, state)


def load_draft(folder: str | Path, target: Target, allow_other_target: bool = False
               ) -> EagleDraft:
    """A draft saved by `save_draft`, on `target`; ValueError when it was trained for another
    target (drafters.checkpoint.check_target) or its file does not hold exactly the draft's
    tensors."""
    folder = Path(folder)
    check_kind(folder, "the EAGLE drafter", EAGLE_KINDS)
    config = read_config(folder)
    check_target(config["target"], target, folder, "EAGLE draft", allow_other_target)
    device = str(target.model.get_output_embeddings().weight.device)
    state = load_tensors(folder / WEIGHTS_FILE, device=device)
    draft = EagleDraft(target.model, tuple(config["feature_layers"]), state.get("vocab_ids"),
                       config["train_lm_head"], config.get("inputs", "both"),  # older: both
                       config.get("layout", "fused_input"))
    draft.load_state_dict(state)  # strict: missing, unexpected or misshapen tensors are named
    return draft


def trained_draft(folder: str | Path, target: Target, allow_other_target: bool = False
                  ) -> EagleDraft:
    """The draft in `folder`: one `save_draft` wrote, or an EAGLE-3 draft in the speculators
    layout (an export of ours, or a draft the speculators library trained and saved:
    experiments.speculators_trainer), read by `load_speculators_eagle3`."""
    if checkpoint_kind(folder) == "speculators":
        return load_speculators_eagle3(folder, target, allow_other_target)
    return load_draft(folder, target, allow_other_target)


def load_speculators_eagle3(folder: str | Path, target: Target, allow_other_target: bool = False
                            ) -> EagleDraft:
    """An EAGLE-3 draft from a speculators eagle3 folder (drafters.export writes one), on
    `target` (whose embedding it shares); ValueError for another format, a draft of another
    target (fingerprint where exported here, else sizes and embedding) or tensors that are
    not exactly the draft's."""
    folder = Path(folder)
    config, state, vocab_ids = read_speculators(folder, "eagle3", target, allow_other_target)
    check_eagle3_forward(config, folder)
    draft = EagleDraft(target.model, tuple(config["eagle_aux_hidden_state_layer_ids"]),
                       vocab_ids, train_lm_head=True, layout="eagle3")
    draft.body.norm_before_residual = bool(config.get("norm_before_residual", True))
    load_eagle3_weights(draft, state, target, folder)
    return draft


def configured_draft(config: EagleConfig, target: Target) -> EagleDraft:
    """The draft an EAGLE drafter config names: its checkpoint (`trained_draft`; its saved
    settings apply, and a draft of the other variant is refused by name), else a fresh one
    made with the config's layers, inputs and layout."""
    if not config.checkpoint:
        layers = config.feature_layers or default_layers(config.variant,
                                                         num_layers(target.model.config))
        return EagleDraft(target.model, tuple(layers), train_lm_head=config.train_lm_head,
                          inputs=config.inputs, layout=config.layout)
    draft = trained_draft(config.checkpoint, target, config.allow_other_target)
    if draft.variant != config.variant:  # it would run, and report, under the wrong name
        raise ValueError(f"{config.checkpoint} holds an {draft.variant} draft (feature "
                         f"layers {list(draft.feature_layers)}, layout {draft.layout}), "
                         f"not an {config.variant} one: load it with "
                         f"drafter={'eagle3' if draft.variant == 'eagle3' else 'eagle'}")
    return draft


def from_config(cfg: Mapping, tree: TreeTopology | DynamicTree, target: Target) -> EagleDrafter:
    """conf/drafter/eagle.yaml / eagle3.yaml: a fresh (untrained) draft, or `checkpoint:
    <folder>` for a trained one (whose saved settings then apply): ours, or a speculators
    EAGLE-3 folder (`trained_draft`)."""
    config = eagle_config(cfg)
    return EagleDrafter(configured_draft(config, target), tree, name=config.name)
