"""Prompt lookup decoding: drafts copied from earlier in the context, no model at all.

If the context's last n tokens occurred before, what followed them then is a good guess for
what follows now (code edits, summaries, multi-turn chat quote their input). Every earlier
occurrence of the trailing n-gram (longest n first, most recent first) gives a candidate
continuation; the shared topology is filled from them: the child of rank r under a node is the
r-th distinct next token among the candidates that agree with the path to that node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from drafters.base import StatelessDrafter
from drafters.config import typed_config
from drafters.trees.steps import check_depth
from verify.protocol import DraftContext
from verify.runtime.model import Target
from verify.tree import TokenTree, TreeBuilder, TreeTopology


@dataclass
class PromptLookupConfig:
    """conf/drafter/prompt_lookup.yaml, typed: the only defaults of these keys."""

    name: str = "prompt_lookup"
    max_ngram: int = 3
    min_ngram: int = 2  # unigram matches are mostly wrong: depth-1 acceptance 0.26 vs 0.46
    max_depth: int = 8  # long copied continuations are rarely right to the end


class PromptLookupDrafter(StatelessDrafter):
    """Fills the topology with n-gram continuations found in the context.

    The drafts are deterministic (draft_probs None), so exact sampling treats each as a
    one-hot proposal. A context without a match gives a partial tree, down to the root alone.
    """

    def __init__(self, topology: TreeTopology, max_ngram: int = PromptLookupConfig.max_ngram,
                 min_ngram: int = PromptLookupConfig.min_ngram,
                 max_depth: int = PromptLookupConfig.max_depth, name: str = "prompt_lookup"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        # Long copied continuations are rarely right to the end: the depth is capped on purpose.
        check_depth(topology, max_depth, name)
        self.topology = topology
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth = max_depth
        self.name = name

    def propose(self, ctx: DraftContext) -> TokenTree:
        tokens = ctx.tokens.cpu()
        starts = self.candidates(tokens)
        return fill_from_continuations(self.topology, tokens.tolist(), starts)

    def candidates(self, tokens: torch.Tensor) -> list[int]:
        """Where each candidate continuation starts in the (T,) context, best first.

        Longest n-gram matches first, most recent first within one n; a shorter match ending
        where a longer one ends adds nothing (same continuation) and is skipped.
        """
        starts: list[int] = []
        seen: set[int] = set()
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            # Windows over tokens[:-1] exclude the trailing n-gram itself, and every match
            # leaves at least one token after it.
            windows = tokens[:-1].unfold(0, n, 1)  # (T - n, n)
            hits = (windows == tokens[-n:]).all(1).nonzero().flatten() + n
            for start in reversed(hits.tolist()):
                if start not in seen:
                    seen.add(start)
                    starts.append(start)
        return starts


def fill_from_continuations(topology: TreeTopology, tokens: list[int], starts: list[int]
                            ) -> TokenTree:
    """The topology filled from the context's continuations tokens[s:] for s in `starts` (best
    first): a node of rank r takes the r-th distinct next token among the continuations that
    agree with its path.

    Topology nodes with no r-th distinct continuation are dropped with their subtrees.
    """
    builder = TreeBuilder(tokens[-1])
    # Per placed topology node: its tree node and the candidates agreeing with its path.
    placed = {0: (0, starts)}
    depth = {0: 0}
    groups: dict[int, list[tuple[int, list[int]]]] = {}  # topology node -> children options
    for node in range(1, topology.size):  # topological order: parents come first
        parent, rank = topology.parents[node], topology.ranks[node]
        if parent not in placed:
            continue
        depth[node] = depth[parent] + 1
        if parent not in groups:
            groups[parent] = _next_tokens(tokens, placed[parent][1], depth[parent])
        if rank < len(groups[parent]):
            token, agreeing = groups[parent][rank]
            placed[node] = (builder.add(placed[parent][0], token), agreeing)
    return builder.build()


def _next_tokens(tokens: list[int], starts: list[int], offset: int) -> list[tuple[int, list[int]]]:
    """Distinct tokens at tokens[s + offset], in order of first appearance, each with the
    candidates that continue with it. Candidates that end before the offset drop out."""
    options: dict[int, list[int]] = {}  # dicts keep insertion order: best candidate first
    for start in starts:
        if start + offset < len(tokens):
            options.setdefault(tokens[start + offset], []).append(start)
    return list(options.items())


def from_config(cfg: Mapping, topology: TreeTopology, target: Target) -> PromptLookupDrafter:
    """conf/drafter/prompt_lookup.yaml; the target is not needed (no model)."""
    config: PromptLookupConfig = typed_config(PromptLookupConfig, cfg, "prompt lookup")
    return PromptLookupDrafter(topology, config.max_ngram, config.min_ngram, config.max_depth,
                               config.name)
