"""The draft -> verify -> accept loop.

One step: the drafter proposes a tree rooted at the last decided token, the target scores every
node in one forward, the acceptance rule picks a path plus a bonus token, the cache keeps the
path, and the bonus token becomes the next root. With no drafter every tree is the root alone,
which is plain decoding through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from verify.accept import AcceptanceRule, make_rule
from verify.protocol import DraftContext, Drafter
from verify.sampling import SamplingParams, sample, warp
from verify.tree import TokenTree
from verify.verifier import TreeVerifier, context_window


@dataclass
class StepStats:
    """One target forward: draft tokens accepted (bonus not counted), the tree's size/depth."""

    accepted: int
    tree_size: int
    tree_depth: int
    draft_s: float
    verify_s: float


@dataclass
class GenerationResult:
    """tokens: (M,) the new tokens (EOS included when generated); steps: one per target forward
    after the prefill."""

    tokens: torch.Tensor
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens produced per target forward, bonus token included."""
        return sum(s.accepted + 1 for s in self.steps) / max(len(self.steps), 1)

    @property
    def draft_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def verify_s(self) -> float:
        return sum(s.verify_s for s in self.steps)


def generate(model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, *,
             drafter: Drafter | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, rule: str | AcceptanceRule | None = None,
             eos_token_id: int | Sequence[int] | None = None,
             generator: torch.Generator | None = None) -> GenerationResult:
    """Speculative generation from a (T,) prompt; with drafter=None, plain decoding.

    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. The same warp
    applies to target and draft distributions. The rule defaults to greedy at temperature 0
    and exact tree sampling otherwise ("typical" selects Medusa's lossy rule). Generation
    stops at any of the EOS ids (models such as Llama-3-Instruct list several), as Hugging
    Face `generate` does.
    """
    params = SamplingParams(temperature, top_k, top_p)
    input_ids = _check_inputs(model, input_ids, max_new_tokens)
    rule = rule if isinstance(rule, AcceptanceRule) else make_rule(rule, params)
    stop = _eos_set(eos_token_id)
    verifier = TreeVerifier(model, drafter.feature_layers if drafter is not None else ())
    start = time.perf_counter()
    logits, features = verifier.prefill(input_ids)
    tokens = [sample(warp(logits, params), generator)]
    result = GenerationResult(torch.empty(0, dtype=torch.long),
                              prefill_s=time.perf_counter() - start)
    if drafter is not None:
        drafter.begin(input_ids)
    finished = tokens[0] in stop
    while len(tokens) < max_new_tokens and not finished:
        context = torch.cat([input_ids, torch.tensor(tokens)])
        new, features = _step(verifier, drafter, rule, context, features, params, generator,
                              result)
        tokens.extend(new)
        finished = not stop.isdisjoint(new)  # an EOS inside the accepted path ends it too
    result.tokens = _truncate(tokens, max_new_tokens, stop)
    return result


def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(i) for i in eos_token_id)


def _step(verifier: TreeVerifier, drafter, rule: AcceptanceRule, context: torch.Tensor,
          features: torch.Tensor | None, params: SamplingParams,
          generator: torch.Generator | None, result: GenerationResult):
    start = time.perf_counter()
    tree = _propose(drafter, context, features, params, generator, verifier)
    drafted = time.perf_counter()
    logits, tree_features = verifier.verify(tree)
    acceptance = rule(tree, logits, params, generator)
    verifier.commit(acceptance.path)
    verified = time.perf_counter()
    if drafter is not None:
        drafter.update(tree, acceptance)
    result.steps.append(StepStats(acceptance.num_accepted, len(tree), tree.depth,
                                  drafted - start + time.perf_counter() - verified,
                                  verified - drafted))
    new = [int(t) for t in tree.tokens[acceptance.path[1:]]] + [acceptance.bonus]
    if tree_features is not None:
        path = torch.tensor(acceptance.path, device=tree_features.device)
        tree_features = tree_features.index_select(0, path)
    return new, tree_features


def _propose(drafter, context: torch.Tensor, features: torch.Tensor | None,
             params: SamplingParams, generator: torch.Generator | None,
             verifier: TreeVerifier) -> TokenTree:
    root_only = TokenTree(context[-1:], torch.tensor([-1]))
    if drafter is None:
        return root_only
    tree = drafter.propose(DraftContext(context, features, params, generator))
    if int(tree.tokens[0]) != int(context[-1]):
        raise ValueError(f"drafter returned a tree rooted at {int(tree.tokens[0])}, "
                         f"not at the last token {int(context[-1])}")
    # Near the end of the context window there is no room for a tree: decode plainly.
    window = context_window(verifier.model)
    return tree if window is None or tree.depth < window - verifier.length else root_only


def _check_inputs(model: PreTrainedModel, input_ids: torch.Tensor,
                  max_new_tokens: int) -> torch.Tensor:
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    if input_ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    limit = context_window(model)
    if limit is not None and len(input_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's context window of {limit} tokens")
    return input_ids


def _truncate(tokens: list[int], max_new_tokens: int, stop: frozenset[int]) -> torch.Tensor:
    tokens = tokens[:max_new_tokens]
    ends = [i for i, token in enumerate(tokens) if token in stop]
    if ends:
        tokens = tokens[: ends[0] + 1]
    return torch.tensor(tokens, dtype=torch.long)
