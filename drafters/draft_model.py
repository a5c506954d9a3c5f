"""Draft-model drafting: a separate small causal LM with the target's tokenizer proposes the tree.

Leviathan et al. 2023 / Chen et al. 2023 draft a chain with a small model; SpecInfer expands a
tree from its top-k. Here the shared topology decides the shape: the child of rank r under a node
is the draft model's r-th best proposal after the path to that node (greedy: its top-k tokens;
sampling: draws without replacement from its warped distribution, recorded for exact
acceptance). The draft can be any compatible model, or the target itself cut to its first
layers (`truncated_copy`, a self-draft that needs no training).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from drafters.base import check_depth, fill_by_levels, node_path, shallow_config, typed_config
from drafters.engine import DraftEngine
from verify.accept import Acceptance
from verify.protocol import DraftContext
from verify.sampling import SamplingParams
from verify.target import Target, load_target
from verify.tree import TokenTree, TreeBuilder, TreeTopology
from verify.verifier import cached_forward, context_window


class DraftModelDrafter:
    """Drafts a tree with a small causal LM whose KV cache (drafters.engine) holds the
    committed tokens `cached` (T,).

    Proposing appends the tree's levels to the cache; `update` keeps the entries of the path
    the target accepted, so the next proposal only feeds what the draft has not seen (the
    bonus token, and accepted leaves that were never fed).
    """

    feature_layers = ()  # reads no target hidden states
    max_depth = None  # a language model can continue any path

    def __init__(self, model: PreTrainedModel, topology: TreeTopology, name: str = "draft_model"):
        check_depth(topology, self.max_depth, name)
        self.model = model.eval()
        self.topology = topology
        self.name = name
        self.engine = DraftEngine(model.config)
        self.begin(torch.empty(0, dtype=torch.long))

    def begin(self, prompt: torch.Tensor) -> None:
        """Drop the cache: a new sequence starts (the prompt is fed on the first proposal)."""
        self.engine.reset()
        self.cached = torch.empty(0, dtype=torch.long)
        self.last_tree: TokenTree | None = None

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> TokenTree:
        """A tree over the topology rooted at ctx.tokens[-1]; fewer nodes where the draft
        distribution has too few tokens with mass."""
        self.engine.rollback()  # a tree never followed by update() must not linger
        root_logits = self._catch_up(ctx.tokens)
        self.last_tree = self._expand(int(ctx.tokens[-1]), root_logits, ctx.params,
                                      ctx.generator)
        return self.last_tree

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Keep the draft's entries of the accepted path; crop the rest of the tree."""
        if tree is not self.last_tree:  # the loop decoded without our tree (context's end)
            self.engine.rollback()
            return
        committed = self.engine.commit(acceptance.path)
        accepted = tree.tokens[acceptance.path[1:1 + committed]]
        self.cached = torch.cat([self.cached, accepted])

    def _catch_up(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache the (T,) committed tokens; returns the draft logits (V,) after the last one."""
        tokens = tokens.cpu()
        # Keep the common prefix (the cache may be ahead after a new sequence), but always
        # feed at least the root: its logits are the first level's distribution.
        keep = min(_common_prefix(self.cached, tokens), len(tokens) - 1)
        self.engine.crop(keep)
        self.cached = tokens[:keep]  # in step with the cache, should the forward fail
        logits = self._forward(tokens[keep:], torch.arange(keep, len(tokens)), None,
                               keep_last=True)
        self.engine.extend(len(tokens) - keep)
        self.cached = tokens.clone()
        return logits[-1]

    def _expand(self, root: int, root_logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> TokenTree:
        """Fill the topology level by level: one draft forward per level that has children."""
        return fill_by_levels(self.topology, root, root_logits, self._forward_level,
                              self._depth_limit(), params, generator)

    def _depth_limit(self) -> int:
        """The topology's depth, less near the end of the draft model's position range (a node
        at depth d sits at position T - 1 + d; GPT-2's position table would overflow)."""
        max_positions = context_window(self.model)
        if max_positions is None:
            return self.topology.depth
        return min(self.topology.depth, max_positions - len(self.cached))

    def _forward_level(self, builder: TreeBuilder, nodes: list[int]) -> torch.Tensor:
        """Feed tree `nodes` (the newest level with children) through the cache; returns their
        logits (n, V)."""
        paths = [node_path(builder.parents, node) for node in nodes]
        positions, mask = self.engine.level(paths, self.model.dtype)
        tokens = torch.tensor([builder.tokens[node] for node in nodes])
        return self._forward(tokens, positions, mask)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 attention_mask: torch.Tensor | None, keep_last: bool = False) -> torch.Tensor:
        """(n,) tokens at (n,) positions appended to the cache -> float logits (n or 1, V)."""
        logits, _ = cached_forward(self.model, self.engine.cache, tokens, positions,
                                   attention_mask, logits_to_keep=1 if keep_last else 0)
        return logits


def truncated_copy(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target cut to its first `num_layers` decoder layers (plus its final norm and head).

    The copy shares the target's weight tensors (no memory, no training): it is built on the
    meta device and every tensor is assigned from the target. Llama, Qwen2, GPT-2 and other
    models whose config has `num_hidden_layers` (GPT-2: an alias of n_layer).
    """
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total - 1}] for a target of {total} "
                         f"layers, got {num_layers}")
    config = shallow_config(model.config, num_layers)
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    result = draft.load_state_dict(model.state_dict(), strict=False, assign=True)
    _check_dropped_only(result.missing_keys, result.unexpected_keys, num_layers)
    # Non-persistent buffers (rotary inv_freq) are not in the state dict: share them too.
    for name, buffer in draft.named_buffers():
        if buffer.is_meta:
            module, _, attr = name.rpartition(".")
            setattr(draft.get_submodule(module), attr, model.get_buffer(name))
    return draft.eval()


def _check_dropped_only(missing: list[str], unexpected: list[str], num_layers: int) -> None:
    # Every weight of the copy must come from the target, and only the dropped layers' weights
    # may be left over; anything else means the layer list was not where the config says.
    dropped = [k for k in unexpected if (m := re.search(r"\.(\d+)\.", k))
               and int(m.group(1)) >= num_layers]
    left = sorted(set(missing) | (set(unexpected) - set(dropped)))
    if left:
        raise ValueError(f"truncating to {num_layers} layers left weights unmatched: {left[:5]}")


def check_compatible(target_model: PreTrainedModel, target_tokenizer,
                     draft_model: PreTrainedModel, draft_tokenizer) -> None:
    """Refuse a draft whose token ids mean something else than the target's (ValueError)."""
    sizes = target_model.config.vocab_size, draft_model.config.vocab_size
    if sizes[0] != sizes[1]:
        raise ValueError(f"vocabulary sizes differ: target {sizes[0]} vs draft {sizes[1]}")
    if target_tokenizer is None and draft_tokenizer is None:
        return  # tiny random models: ids are all there is
    if target_tokenizer is None or draft_tokenizer is None:
        which = "target" if target_tokenizer is None else "draft"
        raise ValueError(f"tokenizers differ: the {which} has none")
    difference = _first_difference(target_tokenizer.get_vocab(), draft_tokenizer.get_vocab())
    if difference:
        raise ValueError(f"tokenizers differ: {difference}")


def _first_difference(target: dict[str, int], draft: dict[str, int]) -> str | None:
    """The lowest id whose token differs between two vocabularies, described; or None."""
    by_id = [{i: t for t, i in vocab.items()} for vocab in (target, draft)]
    for i in sorted(by_id[0].keys() | by_id[1].keys()):
        if by_id[0].get(i) != by_id[1].get(i):
            return f"id {i} is {by_id[0].get(i)!r} in the target, {by_id[1].get(i)!r} in the draft"
    return None


@dataclass
class DraftModelConfig:
    """conf/drafter/draft_model.yaml, typed: the only defaults of these keys."""

    name: str = "draft_model"
    path: str | None = None  # a folder or hub id; None: the target cut to num_layers layers
    num_layers: int = 6  # of SmolLM2-135M's 30 layers


def from_config(cfg: Mapping, topology: TreeTopology, target: Target) -> DraftModelDrafter:
    """conf/drafter/draft_model.yaml: `path: null` + `num_layers: N` drafts with the target cut
    to N layers; `path: <folder or hub id>` loads that model and checks it is compatible."""
    config: DraftModelConfig = typed_config(DraftModelConfig, cfg, "draft model")
    if config.path is None:
        model = truncated_copy(target.model, config.num_layers)
    else:
        dtype = str(target.model.dtype).removeprefix("torch.")
        draft = load_target(config.path, dtype=dtype)
        check_compatible(target.model, target.tokenizer, draft.model, draft.tokenizer)
        model = draft.model.to(target.model.device)
    return DraftModelDrafter(model, topology, name=config.name)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n
