"""The base classes of the drafters that keep no state between steps; the protocol itself lives
in verify.protocol."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from verify.accept import Acceptance
from verify.protocol import DraftContext
from verify.tree import TokenTree


class StatelessDrafter(ABC):
    """The Drafter protocol's lifecycle for a drafter that keeps nothing between steps: it is
    told of a new sequence and of each acceptance, and does nothing with either; every
    sequence of a batch shares it (`fork` returns it). A subclass writes `propose`; one with
    some state of its own (suffix decoding's tries) overrides only the methods that touch it.
    Such a drafter drafts row by row in `verify.loop.generate_batch`."""

    feature_layers: tuple[int, ...] = ()  # reads no target hidden states
    target_top_k: int = 0  # asks for none of the target's predictions

    def begin(self, prompt: torch.Tensor) -> None:
        """Nothing to reset: every proposal reads its own context."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> TokenTree:
        """A tree whose root is ctx.tokens[-1]."""

    def update(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Nothing to learn: the next context holds the accepted tokens."""

    def fork(self) -> StatelessDrafter:
        """No per-sequence state: every sequence can share this drafter."""
        return self


class StatelessBatchDrafter(StatelessDrafter):
    """A StatelessDrafter that drafts a batch at once (verify.protocol.BatchDrafter), for a
    drafter whose work is cheaper for B rows together (one pass of Medusa's heads reads their
    weights once). A subclass writes `propose_batch`; one sequence is the batch of one."""

    def begin_batch(self, prompts: list[torch.Tensor]) -> None:
        """Nothing to reset for any row."""

    def propose(self, ctx: DraftContext) -> TokenTree:
        return self.propose_batch([ctx])[0]

    @abstractmethod
    def propose_batch(self, ctxs: list[DraftContext]) -> list[TokenTree]:
        """One tree per context, in order; tree b's root is ctxs[b].tokens[-1]."""

    def update_batch(self, trees: list[TokenTree], acceptances: list[Acceptance]) -> None:
        """Nothing to learn for any row."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """No per-row state to drop when rows leave the batch."""
