"""The Drafter protocol: the whole contract between a drafter and the verifier loop.

A drafter proposes a TokenTree rooted at the current last token and is told afterwards what the
target accepted. It never sees the verifier's cache; `verify/` never imports a drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from verify.accept import Acceptance
from verify.sampling import SamplingParams
from verify.tree import TokenTree


@dataclass
class DraftContext:
    """What a drafter may look at when proposing.

    tokens: (T,) long, prompt plus every generated token; tokens[-1] is the tree's root.
    hidden: (k, H) float or None, the target's last-layer hidden states of the k tokens it
            cached last (the prompt after prefill, the accepted path after a step); row -1 is
            the state that predicted the root. Only filled for drafters with `wants_hidden`.
    params: the sampling parameters; drafts must be warped with `verify.sampling.warp`.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor | None
    params: SamplingParams
    generator: torch.Generator | None = None


@runtime_checkable
class Drafter(Protocol):
    """wants_hidden: whether the loop must compute the target's hidden states for it."""

    wants_hidden: bool

    def begin(self, prompt: torch.Tensor) -> None:
        """Forget any previous sequence; `prompt` is (T,) long."""

    def propose(self, ctx: DraftContext) -> TokenTree:
        """A tree whose root is ctx.tokens[-1]."""

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Learn which path of the last proposal the target accepted."""
