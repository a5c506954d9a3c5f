"""The Drafter protocol: the whole contract between a drafter and the verifier loop.

A drafter proposes a TokenTree rooted at the current last token and is told afterwards what the
target accepted. It never sees the verifier's cache; `verify/` never imports a drafter.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from verify.accept import Acceptance
from verify.sampling import SamplingParams
from verify.tree import TokenTree


@dataclass
class DraftContext:
    """What a drafter may look at when proposing.

    tokens:   (T,) long, prompt plus every generated token; tokens[-1] is the tree's root.
    features: (k, F * H) or None, the target's hidden states at the drafter's `feature_layers`
              (concatenated in declared order) for the k tokens it cached last: the prompt
              after prefill, the accepted path (root first) after a step. They are the rows of
              positions T - 1 - k .. T - 2, so row -1 is the state that predicted the root. On
              the target's device and in its dtype; None for drafters without feature layers.
    params: the sampling parameters; drafts must be warped with `verify.sampling.warp`.
    """

    tokens: torch.Tensor
    features: torch.Tensor | None
    params: SamplingParams
    generator: torch.Generator | None = None


@runtime_checkable
class Drafter(Protocol):
    """feature_layers: the target hidden states the drafter reads (verify.runtime.features): () for
    none, (-1,) for the state the LM head reads, several for EAGLE-3's fused features.
    target_top_k: K > 0 asks for the target's top-K next tokens after every node of each tree
    it proposed (accepted or not), in `update`'s `acceptance.predictions`
    (verify.predictions.TargetPredictions: ids (N, K) long, logprobs (N, K) float32 of the raw
    target distribution, temperature 1, before warping); 0: none, and None there."""

    feature_layers: tuple[int, ...]
    target_top_k: int

    def begin(self, prompt: torch.Tensor) -> None:
        """Forget any previous sequence; `prompt` is (T,) long."""

    def propose(self, ctx: DraftContext) -> TokenTree:
        """A tree whose root is ctx.tokens[-1]."""

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Learn which path of the last proposal the target accepted (and, with
        target_top_k > 0, what the target predicted at each of its N nodes)."""

    def fork(self) -> Drafter:
        """A drafter for another sequence of a batch: the same weights and settings, its own
        per-sequence state (a stateless drafter may return itself)."""


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A drafter that drafts B sequences together (one draft forward per tree level for all
    of them) instead of one fork per row. `verify.loop.generate_batch` uses these methods when
    a drafter has them, for any B."""

    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        """Forget any previous sequences; B new ones start from these (T_b,) prompts."""

    def propose_batch(self, ctxs: list[DraftContext]) -> list[TokenTree]:
        """One tree per sequence, in `begin_batch`'s order (rows that left excluded); tree b's
        root is ctxs[b].tokens[-1]."""

    def update_batch(self, trees: list[TokenTree], acceptances: list[Acceptance]) -> None:
        """`update` for every sequence of the batch."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` (long indices, in the new order): finished ones
        leave the batch."""


# Optional abilities. A drafter that has one subclasses its protocol explicitly; the commands
# that use an ability find it with isinstance, never by probing attributes.


@runtime_checkable
class Resettable(Protocol):
    """A drafter with a memory of earlier requests (suffix decoding's trie of past answers),
    which a benchmark empties so that every method starts from the same state."""

    def forget(self) -> None:
        """Forget what earlier requests taught; what it was warmed with stays."""


@runtime_checkable
class DraftStats(Protocol):
    """A drafter that runs a draft model (drafters.engine.DraftEngine) and counts its work."""

    @property
    def draft_forwards(self) -> int:
        """Draft forwards run so far: a running count, to diff around a run."""

    def draft_cache_bytes(self) -> int:
        """The memory its draft KV cache holds now (its layers' room: the peak so far)."""


@runtime_checkable
class ProposalCounts(Protocol):
    """A drafter that combines others (drafters.hybrid) and counts whose tree it proposed.

    proposed: member name (or "merged") -> steps, a running count shared by its forks."""

    proposed: Counter
